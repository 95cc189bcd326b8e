"""GPU time of DoRA's kernels over a whole 1B step's layers, against the launch floor.

Development probe (adapters issue): python scripts/probes/dora_kernel_cost.py [--tokens 4096] [--only "launch|row norms|cotangent"] [--shared]
For the bench's 1b model (16 blocks of q,k,v,o,gate,up,down) it issues each piece once per
layer (112 calls) inside one evaluation, several times, and prints the median ms for all
112: the row-norm kernel a launch a layer (and its block layouts) and a launch per shape of
layer (7 launches, as a training step takes them: step_norms.py), the cotangent kernels (and
their block counts, and dora_variants.py's forms), the base product x W^T, g * rs, and a
one-element add (the per-launch floor).
No synchronisation inside a batch, so these are GPU + encode times, not round trips.
"""
import argparse
import os
import sys
import time

import mlx.core as mx

from meshtune.adapters import kernels as K

sys.path.insert(0, os.path.dirname(__file__))
import dora_variants as V  # noqa: E402  (candidate kernels, beside the current ones)

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=4096)
p.add_argument("--rank", type=int, default=8)
p.add_argument("--reps", type=int, default=7)
p.add_argument("--only", default="", help="|-separated starts of the piece names to time (default: all)")
p.add_argument("--shared", action="store_true",
               help="one set of arrays per shape, as before: the 16 layers of a shape then read the same W, g and y, "
                    "much of it from the L2 cache, so the times undercount a step's (every layer its own arrays)")
args = p.parse_args()
H, I, KV = 2048, 6144, 1024
shapes = [(H, H), (KV, H), (KV, H), (H, H), (I, H), (I, H), (H, I)] * 16  # (out, in)
dt = mx.bfloat16


def layer_arrays(out, inp):
    W = (mx.random.normal((out, inp)) * inp ** -0.5).astype(dt)
    w_sq = (W.astype(mx.float32) ** 2).sum(-1)
    a = mx.random.normal((inp, args.rank)) * 0.02
    b = mx.random.normal((args.rank, out)) * 0.01
    x = mx.random.normal((args.tokens, inp)).astype(dt)
    g = mx.random.normal((args.tokens, out)).astype(dt)
    y = mx.random.normal((args.tokens, out)).astype(dt)
    rs = (mx.random.uniform(shape=(out,)) + 0.5).astype(dt)
    d = dict(W=W, w_sq=w_sq, a=a, b=b, m=mx.sqrt(w_sq), x=x, g=g, y=y, rs=rs,
             Wq=mx.quantize(W, group_size=64, bits=4))
    mx.eval(d)
    return d


# Every layer its own arrays (as in a step: W, g and y come from memory, not the L2 cache), or one set a shape.
if args.shared:
    one_set = {s: layer_arrays(*s) for s in set(shapes)}
    layers = [one_set[s] for s in shapes]
else:
    layers = [layer_arrays(*s) for s in shapes]
scaled_sum = mx.compile(lambda base, u, rs: rs * (base + (20.0 * u).astype(base.dtype)))
plain_sum = mx.compile(lambda base, u: base + (20.0 * u).astype(base.dtype))
one = mx.array([1.0])
mx.eval(one)


def batch(piece):
    if getattr(piece, "whole_step", False):
        return piece()
    outs = []
    for d in layers:
        outs.extend(piece(d))
    return outs


def row_norm(d):
    return K.row_norms_cuda([d["W"]], [d["a"]], [d["b"]], [20.0])


def by_shape(row_norms, weight=lambda d: d["W"]):
    """Every layer's norm by `row_norms(weights, A, B, scales)`, the layers of a shape in one launch
    (each its own W, A, B); `weight` is what a layer passes as its weight."""
    def run():
        outs = []
        for s in dict.fromkeys(shapes):
            group = [d for t, d in zip(shapes, layers) if t == s]
            outs.extend(row_norms([weight(d) for d in group], [d["a"] for d in group],
                                  [d["b"] for d in group], [20.0] * len(group)))
        return outs
    run.whole_step = True
    return run


def norms_and_scaled(w, a, b, s, factors=False):
    """The folded step's kernel (kernels.FOLD_ROW_SCALE): the norms, W' = rs W and rs (with `factors`, A and B'), m = 1."""
    return [x for part in K.row_norms_and_scaled_cuda(w, a, b, s, [ONES[v.shape[0]] for v in w], factors=factors)
            for x in part]


ONES = {n: mx.ones((n,)) for n in (H, I, KV)}
mx.eval(ONES)


def folded_step_launch(w, a, b, s):
    """The folded launch as a training step makes it (step_norms.py): norms, W', rs, and A and B' where written."""
    return norms_and_scaled(w, a, b, s, factors=K.writes_factors())


def packed(d):
    """A layer's 4-bit base as the folded step hands it to the launch (kernels.PackedWeight)."""
    return K.PackedWeight(*d["Wq"], bits=4, group_size=64)


def cotangent(d):
    return list(K.cotangent_cuda(d["g"], d["y"], d["m"], d["w_sq"]))


def patched(piece, **constants):
    """`piece` with kernels.py's constants set for the call (_WARPS, _ROWS_PER_WARP,
    _ROW_GROUPS: the row norm's block, default 8 x 2 up to rank 16, 1 group; _COTANGENT_BLOCKS,
    default 528; _STAGE_QUADS; _SCALED_LOADS, default 1; _TILE_FLOATS)."""
    def run(*d):
        saved = {name: getattr(K, name) for name in constants}
        for name, value in constants.items():
            setattr(K, name, value)
        try:
            return piece(*d)
        finally:
            for name, value in saved.items():
                setattr(K, name, value)
    run.whole_step = getattr(piece, "whole_step", False)
    return run


def m_and_b_grads(d):
    """The folded step's m and B gradients for a layer (adapted_linear's backward)."""
    return list(K.magnitude_grad_cuda(d["g"], d["y"], d["m"], d["w_sq"], b_product=d["b"].astype(dt), b_scale=20.0))


pieces = {
    "launch floor (1-element add)": lambda d: [one + 1.0],
    "row norms, a launch a layer": row_norm,
    **{f"row norm, {w} warps x {q} rows": patched(row_norm, _WARPS=w, _ROWS_PER_WARP=q)
       for w, q in ((8, 1), (4, 1))},
    "row norms, a launch a shape (7)": by_shape(K.row_norms_cuda),
    **{f"  the same, {g} row groups a block": patched(by_shape(K.row_norms_cuda), _ROW_GROUPS=g) for g in (2, 4, 8)},
    "row norms and W' = rs W, a launch a shape (7)": by_shape(norms_and_scaled),
    # kernels._RESIDENT_A (A held in registers; the shapes 2048 wide: all but the 2048 x 6144 down projection)
    "folded step launch (7)": by_shape(folded_step_launch),
    "  the same, A staged (not resident)": patched(by_shape(folded_step_launch), _RESIDENT_A=False),
    **{f"  resident, {rows} rows a block, batches of {rb}": patched(by_shape(folded_step_launch), RESIDENT_ROWS=rows,
                                                                   RESIDENT_BATCH=rb)
       for rows, rb in ((32, 4), (128, 4), (64, 2), (64, 8))},
    "  the staged launch (down projection) with tiles of 1024 rows of A (before)": patched(
        by_shape(folded_step_launch), FOLDED_TILE_ROWS=1024),
    "4-bit packed folded step launch (7)": by_shape(folded_step_launch, weight=packed),
    "  4-bit, A staged (not resident)": patched(by_shape(folded_step_launch, weight=packed), _RESIDENT_A=False),
    "  W' with A staged a float at a time": patched(by_shape(norms_and_scaled), _STAGE_QUADS=False),
    "  norms alone, A staged a float at a time": patched(by_shape(K.row_norms_cuda), _STAGE_QUADS=False),
    **{f"  W' written {n} loads in flight": patched(by_shape(norms_and_scaled), _SCALED_LOADS=n) for n in (2, 4, 8)},
    **{f"  W' with tiles of 256 rows of A, {n} loads in flight": patched(by_shape(norms_and_scaled), _TILE_FLOATS=2048,
                                                                        _SCALED_LOADS=n) for n in (1, 4)},
    "  W' 8 warps x 1 row, tiles of 256, 4 loads in flight": patched(by_shape(norms_and_scaled), _ROWS_PER_WARP=1,
                                                                      _TILE_FLOATS=2048, _SCALED_LOADS=4),
    "  norms alone, tiles of 256 rows of A": patched(by_shape(K.row_norms_cuda), _TILE_FLOATS=2048),
    **{f"two passes: norms and W', {n} loads in flight": patched(by_shape(norms_and_scaled), _TWO_PASS=True,
                                                                 _SCALED_LOADS=n) for n in (1, 4, 8)},
    "two passes: norms alone": patched(by_shape(K.row_norms_cuda), _TWO_PASS=True),
    "two passes, 4-bit: dequantize then norms and W'": patched(by_shape(
        norms_and_scaled, weight=lambda d: mx.dequantize(*d["Wq"], group_size=64, bits=4)), _TWO_PASS=True, _SCALED_LOADS=4),
    "4-bit: dequantize then norms and W' (7)": by_shape(
        norms_and_scaled, weight=lambda d: mx.dequantize(*d["Wq"], group_size=64, bits=4)),
    **{f"  W' block {w},{q},{g}": patched(by_shape(norms_and_scaled), _WARPS=w, _ROWS_PER_WARP=q, _ROW_GROUPS=g)
       for w, q, g in ((8, 2, 1), (8, 2, 2), (8, 2, 4), (8, 2, 8), (4, 2, 4), (8, 1, 4), (8, 4, 1), (8, 4, 2))},
    "m's sums kernels (2)": lambda d: [K.magnitude_grad_cuda(d["g"], d["y"], d["m"], d["w_sq"])],
    # The folded step's form: m's and B's gradients, the second kernel's sums spread over a block's warps (current)
    # or a thread a column (before).
    "m's and B's gradients (2)": m_and_b_grads,
    # dora_variants.py: the column sums' blocks, the last block of a strip adding its chunks
    "m's and B's gradients, one launch": lambda d: list(V.one_launch_magnitude_b_grad(
        d["g"], d["y"], d["m"], d["w_sq"], d["b"].astype(dt), 20.0)),
    "m's and B's gradients, a thread a column (2)": lambda d: list(V.magnitude_b_grad_a_thread_a_column(
        d["g"], d["y"], d["m"], d["w_sq"], d["b"].astype(dt), 20.0)),
    "cotangent kernels (2)": cotangent,
    **{f"cotangent, {n} blocks": patched(cotangent, _COTANGENT_BLOCKS=n) for n in (264, 1056, 2112)},
    "cotangent in one launch": lambda d: list(V.one_launch_cotangent(d["g"], d["y"], d["m"], d["w_sq"])),
    "g * rs": lambda d: [d["g"] * d["rs"]],
    "rs (base + s u) MLX, compiled": lambda d: [scaled_sum(d["y"], d["g"], d["rs"])],
    "base + s u MLX, compiled (LoRA)": lambda d: [plain_sum(d["y"], d["g"])],
    "sum_t g*y (MLX)": lambda d: [(d["g"] * d["y"]).astype(mx.float32).sum(0)],
    "base product x W^T": lambda d: [d["x"] @ d["W"].T],
    "W A (skinny matmul)": lambda d: [d["W"] @ d["a"].astype(dt)],
}
if args.only:
    pieces = {k: f for k, f in pieces.items() if any(k.strip().startswith(w) for w in args.only.split("|"))}
print(f"1b step's 112 adapted layers, tokens {args.tokens}, rank {args.rank}, {mx.default_device()}, "
      f"{'one set of arrays a shape' if args.shared else 'every layer its own arrays'}")
print(f"{'piece':32s} {'build ms':>9s} {'eval ms':>9s}  (median of {args.reps}, first dropped)", flush=True)
for k, f in pieces.items():  # a piece's reps together, printed as it ends (a run cut short keeps what it timed)
    times = []
    try:
        for rep in range(args.reps):
            mx.synchronize()
            t0 = time.perf_counter()
            outs = batch(f)
            t1 = time.perf_counter()
            mx.eval(outs)
            t2 = time.perf_counter()
            times.append((t1 - t0, t2 - t1))
            del outs
    except Exception as e:  # e.g. a block asking for more registers than the GPU has: the next piece still runs
        print(f"{k:32s} failed: {str(e)[:100]}", flush=True)
        continue
    v = sorted(times[1:], key=lambda t: t[1])
    b, e = v[len(v) // 2]
    print(f"{k:32s} {b * 1e3:9.2f} {e * 1e3:9.2f}", flush=True)
