"""Host time to dispatch meshtune's custom CUDA kernels against MLX's own ops, per call.

Development probe (adapters issue). On one H200 DoRA's step spent ~9 ms more in dispatch than
LoRA's (dispatch_cost.py) for ~360 more graph nodes: is a custom kernel dearer to dispatch than
an MLX op? Each piece is called `--calls` times on small arrays (GPU time negligible), lazily;
then `mx.async_eval` (the host's dispatch: on a GPU stream MLX encodes every kernel on the
calling thread) and the wait are timed apart. Prints microseconds a call, median of --reps.

    python scripts/probes/kernel_dispatch.py [--calls 112] [--reps 7]

Then the 1b step's 112 layers' norms (and W', and A and B') in their 4 launches, milliseconds a rep.
"""
import argparse
import statistics
import time

import mlx.core as mx

from meshtune.adapters import kernels as K

p = argparse.ArgumentParser()
p.add_argument("--calls", type=int, default=112)
p.add_argument("--reps", type=int, default=7)
args = p.parse_args()

rows, cols, inp, r = 64, 2048, 2048, 8
g = mx.random.normal((rows, cols)).astype(mx.bfloat16)
y = mx.random.normal((rows, cols)).astype(mx.bfloat16)
m = mx.ones((cols,))
norm = mx.ones((cols,))
rs = mx.ones((cols,)).astype(mx.bfloat16)
W = (mx.random.normal((cols, inp)) * 0.02).astype(mx.bfloat16)
a = mx.random.normal((inp, r)) * 0.02
b = mx.random.normal((r, cols)) * 0.02
mx.eval(g, y, m, norm, rs, W, a, b)

pieces = {
    "MLX g * rs (1 op)": lambda i: [g * rs],
    "MLX sum_t g*y / norm (4 ops)": lambda i: [(g.astype(mx.float32) * y.astype(mx.float32)).sum(0) / norm],
    "MLX B * rs, cast (2 ops)": lambda i: [(b * norm).astype(mx.bfloat16)],
    "custom: m's sums (2 kernels)": lambda i: [K.magnitude_grad_cuda(g, y, m, norm)],
    "custom: cotangent (2 kernels)": lambda i: list(K.cotangent_cuda(g, y, m, norm)),
    "custom: row norm, 1 layer (1 kernel)": lambda i: K.row_norms_cuda([W], [a], [b], [2.0]),
    "custom: norms and W', 1 layer (1 kernel)": lambda i: [x for part in K.row_norms_and_scaled_cuda(
        [W], [a], [b], [2.0], [m]) for x in part],
}


def split_times(make_outputs) -> list[float]:
    """Median seconds of building `make_outputs()`'s graph, of dispatching it (mx.async_eval) and of the wait
    for the result, over --reps (the first dropped)."""
    times = []
    for _ in range(args.reps):
        mx.synchronize()
        t0 = time.perf_counter()
        outs = make_outputs()
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        mx.eval(outs)
        t3 = time.perf_counter()
        times.append((t1 - t0, t2 - t1, t3 - t2))
        del outs
    return [statistics.median(t[k] for t in times[1:]) for k in range(3)]


print(f"{args.calls} calls a rep, {mx.default_device()}; microseconds a call, median of {args.reps - 1} (first dropped)")
print(f"{'piece':44s} {'build':>8s} {'dispatch':>9s} {'wait':>8s}")
for name, piece in pieces.items():
    med = [t * 1e6 / args.calls for t in split_times(lambda: [x for i in range(args.calls) for x in piece(i)])]
    print(f"{name:44s} {med[0]:8.1f} {med[1]:9.1f} {med[2]:8.1f}", flush=True)

# The 1b step's norms as the step takes them (step_norms.py): 112 layers, each its own W, A, B and m, the layers of
# a shape in one launch (4 launches of up to 32 layers: ~130 inputs and ~100 outputs a launch).
H, I, KV = 2048, 6144, 1024
groups = {}
for out, inp in [(H, H), (KV, H), (KV, H), (H, H), (I, H), (I, H), (H, I)] * 16:
    group = groups.setdefault((out, inp), [[], [], [], [], []])
    group[0].append((mx.random.normal((out, inp)) * 0.02).astype(mx.bfloat16))
    group[1].append(mx.random.normal((inp, r)) * 0.02)
    group[2].append(mx.random.normal((r, out)) * 0.02)
    group[3].append(20.0)
    group[4].append(mx.ones((out,)))
mx.eval([x for g in groups.values() for part in g[:3] + g[4:] for x in part])
whole = {
    "norms, 4 launches": lambda: [x for w, a_, b_, s, m_ in groups.values() for x in K.row_norms_cuda(w, a_, b_, s)],
    "norms and W', 4 launches": lambda: [x for w, a_, b_, s, m_ in groups.values()
                                         for part in K.row_norms_and_scaled_cuda(w, a_, b_, s, m_) for x in part],
    "norms, W', A and B', 4 launches": lambda: [x for w, a_, b_, s, m_ in groups.values() for part in
                                                K.row_norms_and_scaled_cuda(w, a_, b_, s, m_, factors=True) for x in part],
}
print(f"the 1b step's 112 layers' norms a rep; milliseconds a rep, median of {args.reps - 1}")
for name, piece in whole.items():
    med = [t * 1e3 for t in split_times(piece)]
    print(f"{name:44s} {med[0]:8.2f} {med[1]:9.2f} {med[2]:8.2f}", flush=True)
