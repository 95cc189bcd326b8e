"""Where DoRA's extra step time goes in the whole 1B model, and which rewrite removes it.

Development probe (adapters issue): python scripts/probe_dora_step.py [--preset 1b] [--bases bf16,4bit]
    [--only "current,..."] [--host] [--copies K]
--copies builds K models of LoRA and of each variant (one process's models differed by up to ~20% in host
time on an H200, docs/bench/adapters_h200_24.txt: a variant against another needs more than one of each).
--host splits each overlapped step into build, dispatch and the wait for the step before: on an H200
the wait is ~0, so the step is the host's (docs/bench/dora_host_h200.txt). Each variant swaps DoRALinear's training forward (and its optimizer, where it names one);
LoRA is the baseline. Timed like `meshtune bench adapters` (interleaved rounds, median).
The bound variants drop work (no norm, no m-gradient) and are not DoRA: they only show
what each part costs.
"""
import argparse
import statistics
import sys
from pathlib import Path

import mlx.core as mx

from meshtune.adapters import adapted_linear as AL
from meshtune.adapters import dora as D
from meshtune.adapters import kernels as K
from meshtune.adapters import step_norms
from meshtune.adapters.base_path import dense_weight_for
from meshtune.adapters.adapted_linear import adapted_linear
from meshtune.bench import adapters as B
from meshtune.bench.models import Shape

sys.path.insert(0, str(Path(__file__).parent / "probes"))
import dora_variants as V  # noqa: E402
from packed_magnitudes import PackedMagnitudesAdam  # noqa: E402
import scaled_weight as SW  # noqa: E402

ORIGINAL = D.DoRALinear.__call__
ON_CUDA = K.on_cuda


def v_const(self, x):
    """Bound: LoRA's adapted product times a constant row scale (no norm, no m-gradient)."""
    if not self.training:
        return ORIGINAL(self, x)
    dense = dense_weight_for(self.linear, x.size // x.shape[-1])
    if dense is None:
        return ORIGINAL(self, x)
    rs = mx.stop_gradient(self.m / mx.sqrt(self._w_sq)).astype(x.dtype)
    y = rs * adapted_linear(x, dense, self.lora_a, self.lora_b, self.scale, x_lora=self.dropout(x))
    return y + self.linear["bias"] if "bias" in self.linear else y


def _with(variant, **built_with):
    """`variant`, its step built with `optimizer` (an optimizer class in place of Adam),
    `prepare` (a change to the model before the step is built) or `row_norms` (in place of
    kernels.row_norms_cuda, which the step calls before the forward)."""
    def built(self, x):
        return variant(self, x)
    built.__dict__.update(built_with)
    return built


def _constant_norm(self, x):
    """Bound: the current code with each layer's norm a constant held from the start,
    ||W||_row (no norm launches): what the step's batched norms cost."""
    _reset()
    step_norms.lookup = lambda layer, tokens: ((ORIGINAL_LOOKUP(layer, tokens) or (None,))[0], layer._probe_norm)
    return ORIGINAL(self, x)


def _hold_norms(model):
    for layer in model.modules():
        if isinstance(layer, D.DoRALinear):
            layer._probe_norm = mx.sqrt(layer._w_sq)
            mx.eval(layer._probe_norm)


_constant_norm.prepare = _hold_norms


def _scaled_weight(self, x):
    """DoRA as LoRA's product on W' = rs W and B' = B rs (scripts/probes/scaled_weight.py): no g * rs
    pass and no row-scale multiply; m's gradient by a sums-only kernel; W' by an MLX multiply a layer."""
    _reset()
    if not self.training:
        return ORIGINAL(self, x)
    tokens = x.size // x.shape[-1]
    shared, norm = step_norms.lookup(self, tokens) or (None, None)
    dense = shared if shared is not None else dense_weight_for(self.linear, tokens)
    if dense is None:
        return ORIGINAL(self, x)
    y = SW.scaled_weight_linear(x, dense, self.lora_a, self.lora_b, self.scale, self.m,
                                norm if norm is not None else self.row_norm(), w_sq=self._w_sq)
    return y + self.linear["bias"] if "bias" in self.linear else y


def _held_fold(self, x):
    """Bound: the folded step with each layer's norm, W' = rs W and rs taken once before the run and held
    (constants of the compiled step): no norm launches and no W' written a step, B' = B rs and m's gradient
    as in the current code. On an H200 the overlapped step is the host's (--host: the wait is ~0), so this
    measures what the step's norm launches cost the host."""
    _reset()
    step_norms.lookup = lambda layer, tokens: (None, layer._probe_fold[0])
    step_norms.lookup_scaled = lambda layer, tokens: layer._probe_fold[1:]
    step_norms.lookup_merged = lambda layer, tokens: False  # the held W' is rs W
    return ORIGINAL(self, x)


def _take_fold(model):
    """Every DoRA layer's (norm, W', rs) now, held on the layer (_held_products' preparation)."""
    for layer in model.modules():
        if isinstance(layer, D.DoRALinear):
            dense = dense_weight_for(layer.linear, 1 << 20)
            layer._probe_fold = tuple(x[0] for x in K.row_norms_and_scaled_cuda(
                [dense], [layer.lora_a], [layer.lora_b], [float(layer.scale)], [layer.m]))
            mx.eval(layer._probe_fold)


def _hold_fold(model):
    """_held_fold's preparation: _take_fold, and the step's norms off (put back by _reset)."""
    _take_fold(model)
    step_norms._covered = lambda layer: False


_held_fold.prepare = _hold_fold
_held_fold.exact_at_start = True  # held from the parameters the check starts from: check_exact checks it


def _held_products(self, x):
    """Bound: the current step's norm launches run (their W' written and kept to the backward), but the
    layers' products read the W' and rs held before the run: with _held_fold, it tells the launches'
    host cost from that of products on a W' made in the step."""
    _reset()

    def held_after_launch(layer, tokens):
        launched = ORIGINAL_LOOKUP_SCALED(layer, tokens)
        w_held, rs_held = layer._probe_fold[1:]
        return (w_held, rs_held) if launched is None else (mx.depends([w_held], [launched[0]])[0], rs_held)
    step_norms.lookup_scaled = held_after_launch
    step_norms.lookup_merged = lambda layer, tokens: False  # the held W' is rs W
    return ORIGINAL(self, x)


_held_products.prepare = _take_fold
_held_products.exact_at_start = True


def _setting(target, then=None, **flags):
    """A prepare step that sets `flags` on `target` (kernels or step_norms) before the variant's step
    is traced, then runs `then` (the variant's own prepare step), if any; _reset puts them back."""
    def run(model):
        for name, value in flags.items():
            setattr(target, name, value)
        if then is not None:
            then(model)
    return run


def _on_the_unfolded_step(variant):
    """`variant` with the fold off (MESHTUNE_DORA_FOLD=0) before its step is traced: it changes pieces
    only the unfolded step runs (the cotangent kernel, the norm lookup, row_norms_cuda, the MLX ops' norm)."""
    built = _with(variant, **variant.__dict__)
    built.prepare = _setting(K, variant.__dict__.get("prepare"), FOLD_ROW_SCALE=False)
    return built


def _kernels_with(**settings):
    """The current layer with kernels.py's names in `settings` set (_reset puts each back)."""
    def variant(self, x):
        _reset()
        for name, value in settings.items():
            setattr(K, name, value)
        return ORIGINAL(self, x)
    return variant


def _one_launch_magnitude_grad(g, y, m, norm, b_product=None, b_scale=1.0, rs_dtype=None):
    """m's and B's gradients in one launch a layer (dora_variants: the last block of a strip adds the chunks' sums,
    the two launches' bits); m's alone as before."""
    if b_product is None:
        return ORIGINAL_SUMS(g, y, m, norm, rs_dtype=rs_dtype)
    return V.one_launch_magnitude_b_grad(g, y, m, norm, b_product, b_scale, rs_dtype=rs_dtype)


def _zero_magnitude_grad(g, y, m, norm, b_product=None, b_scale=1.0, rs_dtype=None):
    """magnitude_grad_cuda's results with m's gradient 0 (B's, where asked, by MLX ops)."""
    if b_product is None:
        return mx.zeros_like(m)
    norm = norm.view() if isinstance(norm, K.StackedNorm) else norm
    rs = (m / norm).astype(rs_dtype or g.dtype).astype(mx.float32)
    return mx.zeros_like(m), (b_scale * b_product).astype(mx.float32) * rs


# Bound: the folded step with m's gradient left 0 (no sums kernels): what m's pass over g and y costs.
_no_magnitude_sums = _kernels_with(B_PRODUCT_IN_SUMS=False, magnitude_grad_cuda=_zero_magnitude_grad)


def _w_sq_outside_state(model):
    """Each DoRA layer's ||w_i||^2 kept as a plain attribute, out of the module's state, so the
    compiled step does not take it as an input (the step's given norms do not read it)."""
    for layer in model.modules():
        if isinstance(layer, D.DoRALinear) and "_w_sq" in layer:
            w_sq = layer.pop("_w_sq")
            object.__setattr__(layer, "_w_sq", w_sq)


def _mlx_scaled_cotangent(self, x):
    """Bound: the current code with the backward's g * rs by MLX and m's gradient left 0
    (no cotangent kernels): what they cost beside one MLX multiply."""
    _reset()
    K.cotangent_cuda = lambda g, y, m, norm: (g * (m / norm).astype(g.dtype), mx.zeros_like(m))
    return ORIGINAL(self, x)


def _no_cotangent(self, x):
    """Bound: the current code with LoRA's backward (g itself for g * rs, m's gradient 0):
    what the cotangent costs in the step, launches and memory traffic together."""
    _reset()
    K.cotangent_cuda = lambda g, y, m, norm: (g, mx.zeros_like(m))
    return ORIGINAL(self, x)


def _constant_norm_no_cotangent(self, x):
    """Bound: both of the above: what is left of DoRA is the forward's row scale and m's Adam."""
    _reset()
    step_norms.lookup = lambda layer, tokens: ((ORIGINAL_LOOKUP(layer, tokens) or (None,))[0], layer._probe_norm)
    K.cotangent_cuda = lambda g, y, m, norm: (g, mx.zeros_like(m))
    return ORIGINAL(self, x)


_constant_norm_no_cotangent.prepare = _hold_norms


def _kernels(on):
    """The current layer with adapted_linear's CUDA kernels on (where CUDA is) or off (MLX ops).
    Left set after the call: the backward (where the cotangent kernel runs) is traced after the forward returns."""
    def variant(self, x):
        _reset()
        K.on_cuda = ON_CUDA if on else (lambda: False)
        return ORIGINAL(self, x)
    return variant


def _separate_rows(self, x):
    """MLX ops, W A as its own r-row product instead of r extra rows on the activations' product."""
    _reset()
    K.on_cuda = lambda: False
    AL.NORM_ROWS_ON_BASE_PRODUCT = False
    return ORIGINAL(self, x)


ORIGINAL_COTANGENT, ORIGINAL_LOOKUP, ORIGINAL_SUMS = K.cotangent_cuda, step_norms.lookup, K.magnitude_grad_cuda
ORIGINAL_LOOKUP_SCALED, ORIGINAL_COVERED = step_norms.lookup_scaled, step_norms._covered
ORIGINAL_FOLD, ORIGINAL_MERGED = K.FOLD_ROW_SCALE, K.MERGED_FOLD
ORIGINAL_LOOKUP_MERGED = step_norms.lookup_merged
ORIGINAL_FOLDED_TILE_ROWS = K.FOLDED_TILE_ROWS


def _norm_per_layer(self, x):
    """The current kernels with each layer's norm in its own launch (the step's batched norms unused)."""
    _reset()
    step_norms.lookup = lambda layer, tokens: None
    return ORIGINAL(self, x)


def _one_launch(self, x):
    _reset()
    K.cotangent_cuda = V.one_launch_cotangent
    return ORIGINAL(self, x)


ORIGINAL_ROW_NORMS = K.row_norms_cuda
# A second GPU stream: DoRA's memory-bound work there may run beside the products (stream_overlap.py).
_SIDE = []


def _side():
    if not _SIDE:
        _SIDE.append(mx.new_stream(mx.gpu))
    return _SIDE[0]


def _on_side(fn):
    def wrapped(*args, **kw):
        with mx.stream(_side()):
            return fn(*args, **kw)
    return wrapped


def _mlx_cotangent(side):
    """g * rs by MLX (which may fuse it into g's producer) and m's column sums by MLX,
    on the second stream where `side`."""
    def cotangent(g, y, m, norm):
        rs = (m / norm).astype(g.dtype)
        gz = g * rs
        if side:
            with mx.stream(_side()):
                return gz, AL.dora_cotangent(g, y, rs, norm)[1]
        return gz, AL.dora_cotangent(g, y, rs, norm)[1]

    def variant(self, x):
        _reset()
        K.cotangent_cuda = cotangent
        return ORIGINAL(self, x)
    return variant


ORIGINAL_LAYOUT = K._WARPS, K._ROWS_PER_WARP, K._COTANGENT_BLOCKS, K._ROW_GROUPS
ORIGINAL_SCALED_LOADS, ORIGINAL_STAGE_QUADS, ORIGINAL_TILE_FLOATS = K._SCALED_LOADS, K._STAGE_QUADS, K._TILE_FLOATS
ORIGINAL_TWO_PASS, ORIGINAL_WRITE_FACTORS = K._TWO_PASS, K._WRITE_FACTORS
ORIGINAL_B_IN_SUMS, ORIGINAL_B_SUMS = K.B_PRODUCT_IN_SUMS, K.magnitude_and_b_grad_cuda
ORIGINAL_B_SUMS_FLOATS = K._B_SUMS_FLOATS


def _layout(warps, rows_per_warp, cotangent_blocks=ORIGINAL_LAYOUT[2], row_groups=ORIGINAL_LAYOUT[3]):
    """The current kernels with another row-norm block (warps x rows a warp, groups of those a
    block) and cotangent grid (the defaults: 8 x 2 up to rank 16, 1 group, 528 blocks);
    dora_kernel_cost.py times them alone."""
    def variant(self, x):
        _reset()
        K._WARPS, K._ROWS_PER_WARP, K._COTANGENT_BLOCKS, K._ROW_GROUPS = (warps, rows_per_warp, cotangent_blocks,
                                                                           row_groups)
        return ORIGINAL(self, x)
    return variant


def _reset():
    K.on_cuda = ON_CUDA
    K.FOLD_ROW_SCALE, K.MERGED_FOLD = ORIGINAL_FOLD, ORIGINAL_MERGED
    step_norms.lookup_merged = ORIGINAL_LOOKUP_MERGED
    AL.NORM_ROWS_ON_BASE_PRODUCT = True
    K.cotangent_cuda, step_norms.lookup, K.magnitude_grad_cuda = ORIGINAL_COTANGENT, ORIGINAL_LOOKUP, ORIGINAL_SUMS
    step_norms.lookup_scaled, step_norms._covered = ORIGINAL_LOOKUP_SCALED, ORIGINAL_COVERED
    K._WARPS, K._ROWS_PER_WARP, K._COTANGENT_BLOCKS, K._ROW_GROUPS = ORIGINAL_LAYOUT
    K._SCALED_LOADS, K._STAGE_QUADS, K._TILE_FLOATS = ORIGINAL_SCALED_LOADS, ORIGINAL_STAGE_QUADS, ORIGINAL_TILE_FLOATS
    K._TWO_PASS, K._WRITE_FACTORS = ORIGINAL_TWO_PASS, ORIGINAL_WRITE_FACTORS
    K.FOLDED_TILE_ROWS = ORIGINAL_FOLDED_TILE_ROWS
    K.B_PRODUCT_IN_SUMS, K.magnitude_and_b_grad_cuda = ORIGINAL_B_IN_SUMS, ORIGINAL_B_SUMS
    K._B_SUMS_FLOATS = ORIGINAL_B_SUMS_FLOATS


VARIANTS = {
    "current": _kernels(True),
    # W' = rs W and LoRA's branch products beside it, as before kernels.MERGED_FOLD
    "folded not merged (before)": _with(_kernels(True), prepare=_setting(K, MERGED_FOLD=False)),
    "B's product by a matmul (before)": _kernels_with(B_PRODUCT_IN_SUMS=False),
    # one launch a layer for m's and B's gradients: each strip's last block adds the chunks
    "B in the sums in one launch (last block)": _kernels_with(
        magnitude_and_b_grad_cuda=V.one_launch_magnitude_and_b_sums),
    # rank 8 four columns a thread (fewer registers than eight's 113, more blocks an SM)
    "B sums 32 floats a thread": _kernels_with(_B_SUMS_FLOATS=32),
    "MLX ops (no kernels)": _kernels(False),
    "MLX ops, separate W A product": _separate_rows,
    "norm a launch a layer": _norm_per_layer,
    "one-launch cotangent (last block sums)": _one_launch,
    "row norm 8 warps x 1 row": _layout(8, 1),
    "cotangent 1056 blocks": _layout(8, 2, 1056),
    "Adam on m packed": _with(_kernels(True), optimizer=PackedMagnitudesAdam),
    "one-launch cotangent and Adam on m packed": _with(_one_launch, optimizer=PackedMagnitudesAdam),
    "row norm 4 groups a block": _layout(8, None, row_groups=4),
    "row norm 8 groups a block": _layout(8, None, row_groups=8),
    "MLX cotangent": _mlx_cotangent(False),
    "MLX cotangent with m's sums on a second stream": _mlx_cotangent(True),
    "norms on a second stream": _with(_kernels(True), row_norms=_on_side(ORIGINAL_ROW_NORMS)),
    "norms and m's sums on a second stream": _with(_mlx_cotangent(True), row_norms=_on_side(ORIGINAL_ROW_NORMS)),
    "w_sq out of the state": _with(_kernels(True), prepare=_w_sq_outside_state),
    "packed m and one-launch cotangent and w_sq out": _with(_one_launch, optimizer=PackedMagnitudesAdam,
                                                       prepare=_w_sq_outside_state),
    "scaled weight (rs folded into W and B)": _scaled_weight,
    "unfolded (rs on the sum and the cotangent)": _kernels(True),
    "bound: folded with no m sums": _no_magnitude_sums,
    "m and B gradients in one launch (last block)": _kernels_with(
        B_PRODUCT_IN_SUMS=False, magnitude_grad_cuda=_one_launch_magnitude_grad),
    "folded tiles of 1024 rows of A (before)": _with(_kernels(True), prepare=_setting(K, FOLDED_TILE_ROWS=1024)),
    "bound: folded with W' held (no norm launches)": _held_fold,
    "bound: folded with W' held in the products (norms launched)": _held_products,
    **{f"W' written {n} loads in flight": _with(_kernels(True), prepare=_setting(K, _SCALED_LOADS=n)) for n in (4, 8)},
    "A staged a float at a time": _with(_kernels(True), prepare=_setting(K, _STAGE_QUADS=False)),
    "tiles of 256 rows of A": _with(_kernels(True), prepare=_setting(K, _TILE_FLOATS=2048)),
    "two passes": _with(_kernels(True), prepare=_setting(K, _TWO_PASS=True)),
    "factors cast by the layers": _with(_kernels(True), prepare=_setting(K, _WRITE_FACTORS=False)),
    "one pass": _with(_kernels(True), prepare=_setting(K, _TWO_PASS=False)),
    **{f"two passes and W' {n} loads in flight": _with(_kernels(True), prepare=_setting(K, _TWO_PASS=True, _SCALED_LOADS=n))
       for n in (4, 8)},
    "tiles of 256 and W' 4 loads in flight": _with(_kernels(True), prepare=_setting(K, _TILE_FLOATS=2048,
                                                                                    _SCALED_LOADS=4)),
    "bound: no cotangent": _no_cotangent,
    "bound: constant norm and no cotangent": _constant_norm_no_cotangent,
    "bound: const scale": v_const,
    "bound: m frozen": _with(_kernels(True), prepare=lambda model: model.freeze(keys=["m"], strict=False)),
    "bound: constant norm": _constant_norm,
    "bound: MLX g*rs and dm 0": _mlx_scaled_cotangent,
}
# The variants written for the step before the fold (the folded step runs none of what they change).
for _name in ("MLX ops (no kernels)", "MLX ops, separate W A product", "norm a launch a layer",
              "one-launch cotangent (last block sums)", "cotangent 1056 blocks",
              "one-launch cotangent and Adam on m packed", "MLX cotangent",
              "MLX cotangent with m's sums on a second stream", "norms on a second stream",
              "norms and m's sums on a second stream", "packed m and one-launch cotangent and w_sq out",
              "unfolded (rs on the sum and the cotangent)", "bound: no cotangent",
              "bound: constant norm and no cotangent", "bound: constant norm", "bound: MLX g*rs and dm 0"):
    VARIANTS[_name] = _on_the_unfolded_step(VARIANTS[_name])


def check_exact(shape, a, dtype, names=None):
    """Every real (non-bound) variant's (of `names`, where given) loss and gradients against the current
    code on a small case."""
    import mlx.nn as nn

    from meshtune.bench.models import add_adapters, build_model, perturb_adapters

    small = Shape(arch="qwen3", layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=512)
    model = build_model(small, dtype, quantized=False, seed=0)
    add_adapters(model, impl="meshtune", kind="dora", num_layers=-1, rank=8, scale=20.0)
    perturb_adapters(model, seed=1)
    model.train()
    tok = mx.random.randint(0, 512, (2, 65), key=mx.random.key(3))

    def loss(model):
        logits = model(tok[:, :-1]).astype(mx.float32)
        return nn.losses.cross_entropy(logits, tok[:, 1:]).mean()

    def value_and_grad():  # as the training step takes it: every layer's norm first
        with step_norms.step_row_norms(model, tok[:, :-1].size):
            return nn.value_and_grad(model, loss)(model)

    D.DoRALinear.__call__ = ORIGINAL
    ref_l, ref_g = value_and_grad()
    from mlx.utils import tree_flatten
    ref = dict(tree_flatten(ref_g))
    for name, fn in VARIANTS.items():
        if ((name.startswith("bound") and not getattr(fn, "exact_at_start", False)) or name == "current"
                or (names is not None and name not in names)):
            continue
        D.DoRALinear.__call__ = fn
        _reset()  # the step's norms are taken before the forward's own _reset: no flag of the last variant's
        if getattr(fn, "prepare", None):
            fn.prepare(model)
        K.row_norms_cuda = getattr(fn, "row_norms", ORIGINAL_ROW_NORMS)  # taken before the forward
        l, g = value_and_grad()
        K.row_norms_cuda = ORIGINAL_ROW_NORMS
        got = dict(tree_flatten(g))
        worst = max((mx.abs(got[k] - v).max() / (mx.abs(v).max() + 1e-12)).item() for k, v in ref.items())
        print(f"check {name:<28} loss diff {abs(l.item() - ref_l.item()):.2e}  worst rel grad diff {worst:.2e}", flush=True)
    D.DoRALinear.__call__ = ORIGINAL
    _reset()


class _HostTimes:
    """--host: each timed call's seconds in mx.async_eval (dispatch) and in waiting for the step before
    (OneInFlight.finish), by configuration; the rest of the call is the compiled call and Python."""

    def __init__(self):
        import time

        from meshtune.train import OneInFlight
        self.calls: dict[str, list[tuple[float, float, float]]] = {}
        self._now, self._parts = time.perf_counter, [0.0, 0.0]
        real_eval, real_finish = mx.async_eval, OneInFlight.finish

        def async_eval(*args, **kw):
            t = self._now()
            real_eval(*args, **kw)
            self._parts[0] += self._now() - t

        def finish(in_flight):
            t = self._now()
            real_finish(in_flight)
            self._parts[1] += self._now() - t
        mx.async_eval, OneInFlight.finish = async_eval, finish

    def timed(self, name, run):
        self._parts[:] = [0.0, 0.0]
        t = self._now()
        out = run()
        total = self._now() - t
        self.calls.setdefault(name, []).append((total - sum(self._parts), *self._parts))
        return out

    def report(self, base):
        print(f"{base}: median ms a step (warm-up calls included in the medians' pool)   build  dispatch    wait")
        for name, calls in self.calls.items():
            parts = [sorted(c[k] for c in calls)[len(calls) // 2] * 1e3 for k in range(3)]
            print(f"  {base} {name:<28} {parts[0]:8.2f} {parts[1]:9.2f} {parts[2]:7.2f}", flush=True)
        self.calls.clear()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="1b")
    p.add_argument("--bases", default="bf16,4bit")
    p.add_argument("--only", default="")
    p.add_argument("--host", action="store_true",
                   help="also split each configuration's overlapped step into the host's dispatch (mx.async_eval: on a "
                        "GPU stream MLX encodes every kernel on the calling thread), the wait for the step before, and "
                        "the rest (the compiled call that builds the graph, Python)")
    p.add_argument("--copies", type=int, default=1,
                   help="build LoRA's and each variant's model this many times, timed in the same interleaved rounds, "
                        "and report each copy and the median of the copies: on an H200 the same code's host time moved "
                        "by up to ~20%% from one process (one model) to the next (docs/bench/adapters_h200_24.txt, block 5)")
    p.add_argument("--pin", default="", choices=["", "none", "node", "main"],
                   help="pin the process's threads before timing (scripts/probes/pinning.py): node, the GPU's NUMA "
                        "node; main, the main thread alone on a core; none, print where they run and leave them")
    args, rest = p.parse_known_args()
    if args.copies < 1:
        p.error(f"--copies {args.copies}: give 1 or more models a configuration")
    host = _HostTimes() if args.host else None
    a = B._settings(["--preset", args.preset, *rest])
    shape = B.shape_of(a)
    dtype = mx.bfloat16 if not B._on_cpu() else mx.float32
    variants = {k: v for k, v in VARIANTS.items() if not args.only or k in args.only.split(",")}
    check_exact(shape, a, dtype, set(variants))
    for base in args.bases.split(","):
        steps, configurations = {}, {}  # configurations: a step's name -> (kind, copy suffix)
        for copy in range(args.copies):
            suffix = f" #{copy + 1}" if args.copies > 1 else ""
            for name, run in _configurations(base, a, shape, dtype, variants, host, suffix).items():
                steps[name + suffix] = run
                configurations[name + suffix] = (name, suffix)
        if args.pin:
            import pinning
            print(pinning.describe() + "\n" + pinning.pin(args.pin), flush=True)
        ms = B.time_steps(steps, a)
        _report(base, a, ms, configurations, args.copies)
        if args.pin:
            print(f"threads after timing (--pin {args.pin}):\n" + pinning.threads(), flush=True)
        if host:
            host.report(base)
        del steps
        B._release()
    return 0


def _configurations(base, a, shape, dtype, variants, host, suffix=""):
    """{name: a timed step}: LoRA's, then each variant's DoRA step, each on a model of its own (`suffix`: the
    copy's, in the names --host reports)."""
    lora_run = B.build_step("meshtune", "lora", base, a, shape, dtype)
    steps = {"lora": (lambda: host.timed("lora" + suffix, lora_run)) if host else lora_run}
    steps["lora"].finish = lora_run.finish
    for name, fn in variants.items():
        # Each variant's model traces its compiled step with its own forward at first call, from
        # the settings put back (step_row_norms runs before the forward's _reset: a flag the last
        # variant's prepare step set, the fold off, would otherwise carry over to this one's norms).
        D.DoRALinear.__call__ = fn
        _reset()
        adam, B.optim.Adam = B.optim.Adam, getattr(fn, "optimizer", B.optim.Adam)  # the variant's optimizer, if any
        add = B.add_adapters
        if getattr(fn, "prepare", None):  # the variant's change to the model (frozen parameters), if any
            B.add_adapters = lambda model, *args, add=add, prepare=fn.prepare, **kw: (
                add(model, *args, **kw), prepare(model))
        # The step's norms are taken before the forward, so the variant's form of them is set
        # before its step is traced (at its first call), and put back after.
        K.row_norms_cuda = getattr(fn, "row_norms", ORIGINAL_ROW_NORMS)
        try:
            run = B.build_step("meshtune", "dora", base, a, shape, dtype)
            run()
        finally:
            B.optim.Adam, B.add_adapters = adam, add
            K.row_norms_cuda = ORIGINAL_ROW_NORMS

        def bound(run=run, fn=fn, name=name + suffix):
            D.DoRALinear.__call__ = fn
            return host.timed(name, run) if host else run()
        bound.finish = run.finish  # a step still in flight (overlapped steps, runtime.overlap_steps)
        steps[name] = bound
    return steps


def _report(base, a, ms, configurations, copies):
    """Each configuration's median step against its copy's LoRA; with copies, then the median over the copies
    of each configuration and its ratio."""
    print(f"{base}: batch {a.batch_size} x {a.seq_len}, {a.steps} steps in {a.rounds} rounds, steps "
          + ("overlapped" if a.overlap else "one after another") + (f", {copies} models a configuration" if copies > 1 else ""))
    for k, v in ms.items():
        lora = ms["lora" + configurations[k][1]]
        print(f"  {base} {k:<28} {v * 1e3:8.2f} ms  {v / lora:5.3f}x LoRA", flush=True)
    if copies > 1:
        kinds: dict[str, list[float]] = {}
        for k, v in ms.items():
            kinds.setdefault(configurations[k][0], []).append(v)
        lora = statistics.median(kinds["lora"])
        print(f"{base}: the median of the {copies} models a configuration (their spread)")
        for k, vs in kinds.items():
            print(f"  {base} {k:<28} {statistics.median(vs) * 1e3:8.2f} ms  {statistics.median(vs) / lora:5.3f}x LoRA"
                  f"  ({min(vs) * 1e3:.2f}-{max(vs) * 1e3:.2f})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
