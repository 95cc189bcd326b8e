"""DoRA's per-layer extra work as CUDA kernels, for MLX's CUDA build: the launches and their layouts.

DoRA adds to a layer's step the norm of its adapted rows (forward) and m's gradient (backward); the host's
dispatch is a large part of a GPU step, so each gets as few launches as the GPU's time allows. The kernels
are the .cuh files in adapters/cuda/, one per family, each opening with its inputs, outputs, launch shape
and test: `dora_row_norms.cuh` (the norms, one launch for every layer of a shape, and the folded step's
W' and rs), `dora_cotangent.cuh` (the backward's pass over g) and `dora_magnitude_grad.cuh` (the chunks
added in a fixed order: m's gradient, and B's). Each launch here is an `mx.fast.cuda_kernel` whose header
is the file and whose body is a call; the only text generated is the switch picking layer blockIdx.y's
arrays among MLX's named inputs (`_select`). Elsewhere (CPU, Metal) adapted_linear computes the same in
MLX ops; tests/cuda/ compares the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from ..runtime.cuda import kernel as _kernel, kernel_constant, on_cuda, read_source  # noqa: F401 (on_cuda: asked here)

SOURCES = Path(__file__).with_name("cuda")
ROW_NORMS, COTANGENT, MAGNITUDE_GRAD = "dora_row_norms.cuh", "dora_cotangent.cuh", "dora_magnitude_grad.cuh"

# A folded training step (adapter.dora_fold; step_norms.py writes W' = rs W beside the norms) holds a dense base's
# W' as a copy through the step: "auto" folds those only while the copies take at most this share of the GPU's
# memory (a quantized base's W' takes the place of its dequantized copy).
FOLD_MEMORY_SHARE = 0.125

# The largest rank the row-norm kernels take (their accumulators live in registers); adapted_linear computes
# larger ones in MLX ops.
MAX_RANK = 64
# Layers one row-norm launch takes at most (each adds four pointers to the kernel's parameters).
MAX_LAYERS_A_LAUNCH = 32

# The staged layout: WARPS warps a block, 2 rows of W a warp up to rank 16 (each value of A read from shared
# memory serves them all), else 1 (they hold r registers each).
WARPS = 8
# Rows of A a shared tile holds in the folded (W'-writing) staged launch, where fewer than the default tile's:
# fewer registers a thread, two blocks an SM.
FOLDED_TILE_ROWS = 256
# The resident layout (folded launches only): a block takes RESIDENT_ROWS rows of a layer, RESIDENT_BATCH at a
# time, where a row fits one block (at most 512 threads) and a thread's VEC x R floats of A fit in 64 registers.
RESIDENT_ROWS = 128
RESIDENT_BATCH = 2
_RESIDENT_MAX_THREADS = 512
_RESIDENT_MAX_A_REGISTERS = 64

# Backward: blocks to aim for in the cotangent pass (~4 an SM of an H200's 132, a chunk at least 32 rows); with
# B's product fewer (the second launch then adds fewer chunks), a thread keeping at most _B_SUMS_FLOATS of B's
# sums; the second launch's warps a block.
_COTANGENT_BLOCKS = 528
_B_SUMS_BLOCKS = 264
_B_SUMS_FLOATS = 64
_SUM_WARPS = 8

# MLX's split is one graph node for up to 10 parts and a Slice a part beyond (mlx/ops.cpp): a launch's
# outputs are handed out by nested splits of at most SPLIT_PARTS parts.
SPLIT_PARTS = 10

# Bit widths whose elements tile a 32-bit word (the 3-, 5- and 6-bit packings straddle words).
PACKED_BITS = (2, 4, 8)


@dataclass(frozen=True)
class RowNormLaunch:
    """How the row-norm launches lay out their work: the constants above (LAUNCH). A test takes others to reach,
    on small shapes, the layouts large ones take: several launches, other tiles and blocks, the staged layout."""

    max_layers: int = MAX_LAYERS_A_LAUNCH
    folded_tile_rows: int = FOLDED_TILE_ROWS
    resident_rows: int = RESIDENT_ROWS
    resident_batch: int = RESIDENT_BATCH
    resident: bool = True
    """Whether a folded launch holds A in registers where the layout allows (else A is staged)."""


LAUNCH = RowNormLaunch()


class PackedWeight(NamedTuple):
    """An affine-quantized base weight as the folded norm launch reads it: (out, in * bits / 32) uint32 words,
    (out, in / group_size) scales and biases in the dtype it dequantizes to."""

    packed: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 32 // self.bits

    @property
    def dtype(self) -> mx.Dtype:
        return self.scales.dtype


class StackedNorm(NamedTuple):
    """A layer's row norms where its step's launch wrote them: entries start .. start + size of the launch's
    one array (its layers' norms one after another). The magnitude-gradient kernel reads them there, so a
    training step's graph holds no view of them (a node a layer); `view()` is that view, for MLX ops."""

    launch: mx.array
    start: int
    size: int

    def view(self) -> mx.array:
        return self.launch[self.start:self.start + self.size]


def packed_weight(layer: nn.Module) -> PackedWeight | None:
    """`layer`'s weight as the folded launch reads it packed (nn.QuantizedLinear, affine, PACKED_BITS, float scales),
    or None: the caller then hands the launch a dequantized copy (so too where reads_packed() says no)."""
    if (not isinstance(layer, nn.QuantizedLinear) or layer.mode != "affine"
            or layer.bits not in PACKED_BITS or "biases" not in layer
            or not mx.issubdtype(layer.scales.dtype, mx.floating) or layer.group_size % (32 // layer.bits)):
        return None
    return PackedWeight(layer.weight, layer.scales, layer["biases"], layer.bits, layer.group_size)


def reads_packed(weight: PackedWeight, r: int) -> bool:
    """Whether the folded launch's layout for rank r takes one word of `weight` a lane (VEC = 32 / bits)."""
    return _packed_layout(r, weight) is not None


def _tile_floats(r: int) -> int:
    """Floats of A a shared tile holds: about 32 KiB (16 KiB past rank 32), under a block's 48 KiB of static
    shared memory."""
    return 8192 if r <= 32 else 4096


def _row_scale_layout(r: int, inp: int, weight_bytes: int, folded: bool = False,
                      tile_rows: int = FOLDED_TILE_ROWS) -> tuple[int, int, int]:
    """(rows of W a warp takes, columns a lane loads at once, rows of A a shared tile holds) of the staged launch:
    one 16-byte load of W where the input width allows; a tile a multiple of a warp's columns, `tile_rows`
    (FOLDED_TILE_ROWS) rows where `folded` and that is less."""
    rows = 2 if r <= 16 else 1
    floats = _tile_floats(r)
    if folded and tile_rows >= 32 * (16 // weight_bytes):  # a warp's 16-byte loads
        floats = min(floats, tile_rows * r)
    vec = 16 // weight_bytes
    while vec > 1 and (inp % vec or floats // r < 32 * vec):
        vec //= 2
    return rows, vec, max(32 * vec, floats // r // (32 * vec) * (32 * vec))


def _packed_layout(r: int, weight: PackedWeight) -> tuple[int, int, int] | None:
    """_row_scale_layout's (rows a warp, columns a lane, tile rows) with a word a lane, or None where a tile of A
    would hold fewer than a warp's columns."""
    vec = 32 // weight.bits
    floats = _tile_floats(r)
    if weight.shape[1] % vec or floats // r < 32 * vec:
        return None
    return 2 if r <= 16 else 1, vec, floats // r // (32 * vec) * (32 * vec)


def _resident_layout(r: int, inp: int, vec: int) -> bool:
    """Whether the folded launch keeps A resident in registers for rank r, rows `inp` wide, `vec` columns a thread."""
    threads = inp // vec
    return inp % (32 * vec) == 0 and threads <= _RESIDENT_MAX_THREADS and vec * r <= _RESIDENT_MAX_A_REGISTERS


def _select(layers: int, assign: str) -> str:
    """The glue MLX forces on a launch of several layers: its inputs are separately named arrays (w0, w1, ...),
    so a switch on blockIdx.y runs `assign` (formatted with i) for layer i; other rows of blocks return."""
    cases = "\n".join(f"    case {i}: {assign.format(i=i)} break;" for i in range(layers))
    return f"switch (blockIdx.y) {{\n{cases}\n    default: return;\n}}"


def _row_norms_body(layers: int, folded: bool, packed: bool, resident: bool) -> str:
    """The row-norm kernel's body: layer blockIdx.y's arrays picked, then dora_row_norms.cuh's kernel called."""
    pick = ("w = w{i}; a = a{i}; b = b{i};" + (" qs = qs{i}; qb = qb{i};" if packed else "")
            + (" m = m{i};" if folded else ""))
    outputs = ("norms, wss, rss, ass, bss" if folded
               else "norms, (WT*)nullptr, (float*)nullptr, (WT*)nullptr, (WT*)nullptr")
    call = ("dora::row_norms_resident<R, IN, OUT, VEC, RPB, RB, MERGED, QB, GS, WT>" if resident
            else "dora::row_norms_staged<WARPS, R, IN, OUT, RPW, VEC, TJ, FOLDED, MERGED, QB, GS, WT>")
    return ("decltype(w0) w;\nconst float* a;\nconst float* b;\nconst WT* qs = nullptr;\nconst WT* qb = nullptr;\n"
            f"const float* m = nullptr;\n{_select(layers, pick)}\n{call}(w, qs, qb, a, b, m, s, {outputs});")


def row_norm_kernel_name(layers: int, folded: bool, packed: bool = False, resident: bool = False,
                         merged: bool = False) -> str:
    """The row-norm kernel's name for a launch of `layers` layers (writing W', rs, A and B' where `folded`, reading
    quantized weights where `packed`, holding A in registers where `resident`, writing the merged W' where
    `merged`): what MLX caches it by (with a digest of its text), and what the simulated tests count launches by."""
    kind = ("_resident" if resident else "") + ("_packed" if packed else "") + ("_merged" if merged else "")
    return f"meshtune_dora_row_norm{kind}{'_folded' if folded else ''}_{layers}"


def row_norms_cuda(weights: list[mx.array], a: list[mx.array], b: list[mx.array],
                   scales: list[float], launch: RowNormLaunch = LAUNCH) -> list[mx.array]:
    """||W + s (A B)^T||_row float32 of each layer, for layers of one shape: W (out, in), A (in, r), B (r, out).

    One launch takes up to MAX_LAYERS_A_LAUNCH layers (a layer per row of blocks), so a
    model's layers of one shape cost a launch or two, not one each.
    """
    return _row_norms(weights, a, b, scales, None, launch=launch)[0]


def row_norms_and_scaled_cuda(weights: list, a: list[mx.array], b: list[mx.array], scales: list[float],
                              magnitudes: list[mx.array], factors: bool = True, stacked: bool = False,
                              merged: bool = False, launch: RowNormLaunch = LAUNCH) -> tuple[list, ...]:
    """(row_norms_cuda's norms, W' = rs W in W's dtype, rs float32, A and B' = B rs in W's dtype) of each layer,
    in the same launches, rs = m / norm rounded to W's dtype: DoRA's row scale folded into the weights
    (adapted_linear's row_scale and factors). `weights` may be PackedWeight (read packed where reads_packed()).
    With `factors` False the result stops after rs (the launch writes A and B' either way).
    With `stacked`, the norms are StackedNorm entries (what magnitude_and_b_grad_cuda takes without a view).
    With `merged`, W' = rs (W + s (A B)^T): the whole adapted weight (adapted_linear's `merged`)."""
    out = _row_norms(weights, a, b, scales, magnitudes, stacked, merged, launch=launch)
    return out if factors else out[:3]


def _row_norms(weights: list, a: list[mx.array], b: list[mx.array], scales: list[float],
               magnitudes: list[mx.array] | None, stacked: bool = False, merged: bool = False, *,
               launch: RowNormLaunch = LAUNCH) -> tuple[list, ...]:
    """(norms,) or, with magnitudes, (norms, W', rs, A, B'): a list each, a layer's entry at its index; with
    `stacked` the norms are StackedNorm entries, not views."""
    if len(weights) > launch.max_layers:
        cut = launch.max_layers

        def part(sl: slice) -> tuple[list, ...]:
            return _row_norms(weights[sl], a[sl], b[sl], scales[sl], magnitudes and magnitudes[sl], stacked, merged,
                              launch=launch)
        return tuple(x + y for x, y in zip(part(slice(None, cut)), part(slice(cut, None))))
    n = len(weights)
    out, inp, wt, r, packed = _one_shape(weights, a, b)
    folded = magnitudes is not None
    layout = (_packed_layout(r, weights[0]) if packed
              else _row_scale_layout(r, inp, wt.size, folded, launch.folded_tile_rows))
    if packed and (layout is None or not folded):
        raise ValueError("row_norms_cuda: a packed weight goes to the folded launch only, where reads_packed()")
    if merged and not folded:
        raise ValueError("row_norms_cuda: a merged W' is the folded launch's (magnitudes given)")
    names = [f"{p}{i}" for p in ("w", "qs", "qb")[:1 + 2 * packed] + ("a", "b") + (("m",) if folded else ())
             for i in range(n)] + ["s"]
    outputs = ["norms"] + (["wss", "rss", "ass", "bss"] if folded else [])
    w_inputs = ([w.packed for w in weights] + [w.scales for w in weights] + [w.biases for w in weights]
                if packed else weights)
    inputs = [*w_inputs, *(x.astype(mx.float32) for x in a), *(y.astype(mx.float32) for y in b),
              *(m.astype(mx.float32) for m in magnitudes or []), kernel_constant(scales, mx.float32)]
    output_shapes = [(n * out,)] + ([(n * out, inp), (n * out,), (n * inp, r), (n * r, out)] if folded else [])
    output_dtypes = [mx.float32] + ([wt, mx.float32, wt, wt] if folded else [])
    # WT puts W's dtype in the name MLX caches the compiled kernel by (the inputs' dtypes are not in it): a
    # float32 W must not run a bfloat16 W's kernel. QB = 0: W dense.
    weight = [("QB", weights[0].bits if packed else 0), ("GS", weights[0].group_size if packed else 0), ("WT", wt)]
    resident_vec = layout[1] if packed else 16 // wt.size  # a packed word a thread, else a 16-byte load
    resident = folded and launch.resident and _resident_layout(r, inp, resident_vec)
    if resident:
        template = [("R", r), ("IN", inp), ("OUT", out), ("VEC", resident_vec), ("RPB", launch.resident_rows),
                    ("RB", launch.resident_batch), ("MERGED", int(merged))]
        threads = inp // resident_vec
        grid = (-(-out // launch.resident_rows) * threads, n, 1)
    else:
        rows, vec, tile = layout
        template = [("WARPS", WARPS), ("R", r), ("IN", inp), ("OUT", out), ("RPW", rows), ("VEC", vec), ("TJ", tile),
                    ("FOLDED", int(folded)), ("MERGED", int(merged))]
        threads = WARPS * 32
        grid = (-(-out // (WARPS * rows)) * threads, n, 1)
    k = _kernel(row_norm_kernel_name(n, folded, packed, resident, merged), names, outputs,
                _row_norms_body(n, folded, packed, resident), read_source(SOURCES / ROW_NORMS))
    res = k(inputs=inputs, template=template + weight, grid=grid, threadgroup=(threads, 1, 1),
            output_shapes=output_shapes, output_dtypes=output_dtypes)
    return _per_layer(res, n, stacked)


def _one_shape(weights: list, a: list[mx.array], b: list[mx.array]) -> tuple[int, int, mx.Dtype, int, bool]:
    """(out, in, weight dtype, rank, packed) of the launch's layers, which must all share them."""
    (out, inp), wt, r = weights[0].shape, weights[0].dtype, a[0].shape[-1]
    packed = isinstance(weights[0], PackedWeight)
    if any(isinstance(w, PackedWeight) != packed or w.shape != (out, inp) or w.dtype != wt or x.shape != (inp, r)
           or y.shape != (r, out) or packed and w[3:] != weights[0][3:] for w, x, y in zip(weights, a, b)):
        raise ValueError("row_norms_cuda: one launch takes layers of one shape, rank and weight dtype "
                         "(and one packing: bits and group size)")
    return out, inp, wt, r, packed


def _per_layer(outputs: list[mx.array], n: int, stacked: bool = False) -> tuple[list, ...]:
    """A launch's outputs for n layers (each the layers' parts one after another; one array a kind for all its
    layers, as an output a layer would carry every input of the launch), as a list of n layers' arrays each:
    views of the one array (layer_views), no copies. With `stacked` the norms (the first output) are
    StackedNorm entries instead."""
    views = [layer_views(x, n) for x in outputs[stacked:]]
    if not stacked:
        return tuple(views)
    size = outputs[0].size // n
    return ([StackedNorm(outputs[0], i * size, size) for i in range(n)], *views)


def layer_views(x: mx.array, n: int) -> list[mx.array]:
    """x's n equal parts along axis 0, views of it, from nested splits of at most SPLIT_PARTS parts each."""
    if n == 1:
        return [x]
    if n <= SPLIT_PARTS:
        return mx.split(x, n)
    # Parts a group (at most SPLIT_PARTS groups), the last group the rest.
    size = -(-n // min(SPLIT_PARTS, -(-n // SPLIT_PARTS)))
    starts = range(0, n, size)
    groups = mx.split(x, [start * (x.shape[0] // n) for start in starts[1:]])
    return [view for group, start in zip(groups, starts) for view in layer_views(group, min(size, n - start))]


def cotangent_grid(rows: int, cols: int, dtype: mx.Dtype) -> tuple[int, int, int, int]:
    """(columns a thread takes, column strips, rows a chunk, chunks) of the cotangent kernel's blocks."""
    vec = 16 // dtype.size
    vec = vec if cols % vec == 0 else 1
    strips = -(-cols // (32 * vec))
    chunk = -(-rows // max(1, min(-(-_COTANGENT_BLOCKS // strips), rows // 32)))
    return vec, strips, chunk, -(-rows // chunk)


def b_sums_grid(rows: int, cols: int, r: int, dtype: mx.Dtype) -> tuple[int, int, int, int]:
    """(columns a thread takes, column strips, rows a chunk, chunks) of the column and B sums' blocks."""
    vec = 16 // dtype.size
    while vec > 1 and (cols % vec or r * vec > _B_SUMS_FLOATS):
        vec //= 2
    strips = -(-cols // (32 * vec))
    chunk = -(-rows // max(1, min(-(-_B_SUMS_BLOCKS // strips), rows // 32)))
    return vec, strips, chunk, -(-rows // chunk)


def _norm_input(norm: mx.array | StackedNorm) -> tuple[mx.array, mx.array]:
    """(norms array, int32 offset of the layer's first in entry 0) for the magnitude-gradient kernel."""
    start = norm.start if isinstance(norm, StackedNorm) else 0
    return (norm.launch if isinstance(norm, StackedNorm) else norm), kernel_constant([start], mx.int32)


def cotangent_cuda(g: mx.array, y: mx.array, m: mx.array, norm: mx.array) -> tuple[mx.array, mx.array]:
    """(g * rs in g's dtype, sum_t g * y / (rs * norm) float32, 0 where rs * norm is 0) for (rows, cols) g, y:
    the unfolded product's backward. rs = m / norm rounded to g's dtype; m and norm are float32 (cols,)."""
    rows, cols = g.shape
    vec, strips, chunk, chunks = cotangent_grid(rows, cols, g.dtype)
    k = _kernel("meshtune_dora_cotangent", ["g", "y", "m", "norm"], ["gz", "part"],
                "dora::column_pass<1, 0, ROWS, COLS, CHUNK, VEC, T, YT, T>(g, y, (const T*)nullptr, m, norm, gz, part, "
                "(float*)nullptr);", read_source(SOURCES / COTANGENT))
    gz, part = k(inputs=[g, y, m.astype(mx.float32), norm],
                 template=[("ROWS", rows), ("COLS", cols), ("CHUNK", chunk), ("VEC", vec), ("T", g.dtype),
                           ("YT", y.dtype)],
                 grid=(strips * 256, chunks, 1), threadgroup=(256, 1, 1),
                 output_shapes=[(rows, cols), (chunks, cols)], output_dtypes=[g.dtype, mx.float32])
    norms, offset = _norm_input(norm)
    grad = _kernel("meshtune_dora_magnitude_grad", ["part", "m", "norms", "off"], ["dm"],
                   "dora::magnitude_grad<WARPS, 0, 0, COLS, CHUNKS, T, T>(part, m, norms, off, (const float*)nullptr, "
                   "(const float*)nullptr, dm, (float*)nullptr);", read_source(SOURCES / MAGNITUDE_GRAD))
    (dm,) = grad(inputs=[part, m.astype(mx.float32), norms, offset],
                 template=[("WARPS", _SUM_WARPS), ("COLS", cols), ("CHUNKS", chunks), ("T", g.dtype)],
                 grid=(-(-cols // 32) * 32 * _SUM_WARPS, 1, 1), threadgroup=(32 * _SUM_WARPS, 1, 1),
                 output_shapes=[(cols,)], output_dtypes=[mx.float32])
    return gz, dm


def magnitude_and_b_grad_cuda(g: mx.array, y: mx.array, u: mx.array, m: mx.array, norm: mx.array | StackedNorm,
                              b_scale: float, rs_dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
    """(m's gradient, B's) for the folded product: sum_t g * y / (rs * norm) float32 (0 where rs * norm is 0) and
    (b_scale * p in g's dtype) * rs float32 with p = u^T g summed in the column sums' pass over g (no matmul; by
    chunks of rows, an order apart from a matmul's: equal to rounding), rs = m / norm rounded to `rs_dtype`
    (default g's). g, y (rows, cols) in the activations' dtype, u = x A (rows, r) in the same; m float32."""
    rows, cols = g.shape
    r = u.shape[-1]
    vec, strips, chunk, chunks = b_sums_grid(rows, cols, r, g.dtype)
    sums = _kernel("meshtune_dora_column_and_b_sums", ["g", "y", "u"], ["part", "bpart"],
                   "dora::column_pass<0, R, ROWS, COLS, CHUNK, VEC, T, YT, UT>(g, y, u, (const float*)nullptr, "
                   "(const float*)nullptr, (T*)nullptr, part, bpart);", read_source(SOURCES / COTANGENT))
    part, bpart = sums(inputs=[g, y, u], template=[("ROWS", rows), ("COLS", cols), ("CHUNK", chunk), ("VEC", vec),
                                                   ("R", r), ("T", g.dtype), ("YT", y.dtype), ("UT", u.dtype)],
                       grid=(strips * 256, chunks, 1), threadgroup=(256, 1, 1),
                       output_shapes=[(chunks, cols), (chunks, r, cols)], output_dtypes=[mx.float32, mx.float32])
    norms, offset = _norm_input(norm)
    grad = _kernel("meshtune_dora_magnitude_b_sums_grad", ["part", "m", "norms", "off", "bpart", "bscale"],
                   ["dm", "gbo"],
                   "dora::magnitude_grad<WARPS, 1, R, COLS, CHUNKS, T, GT>(part, m, norms, off, bpart, bscale, dm, "
                   "gbo);",
                   read_source(SOURCES / MAGNITUDE_GRAD))
    dm, gb = grad(inputs=[part, m.astype(mx.float32), norms, offset, bpart, kernel_constant([b_scale], mx.float32)],
                  template=[("WARPS", _SUM_WARPS), ("COLS", cols), ("CHUNKS", chunks), ("T", rs_dtype or g.dtype),
                            ("R", r), ("GT", g.dtype)],
                  grid=(-(-cols // 32) * 32 * _SUM_WARPS, 1, 1), threadgroup=(32 * _SUM_WARPS, 1, 1),
                  output_shapes=[(cols,), (r, cols)], output_dtypes=[mx.float32, mx.float32])
    return dm, gb
