"""Host cost of one launch, by kind of operation, on the GPU: a graph of N independent tiny
operations, timed as dispatch (mx.async_eval, the host encoding them) and the wait after.

Development probe (adapters issue): python3 scripts/probes/launch_cost.py [--n 1000]
"""
import argparse
import statistics
import time

import mlx.core as mx

from meshtune.cuda import kernel

p = argparse.ArgumentParser()
p.add_argument("--n", type=int, default=1000)
args = p.parse_args()
N = args.n
xs = [mx.full((256,), float(i)) for i in range(N)]
mats = [mx.random.normal((64, 64)) for _ in range(8)]
mx.eval(xs, mats)
copy = kernel("probe_copy", ["x"], ["y"], "int i = threadIdx.x + blockIdx.x * blockDim.x; if (i < 256) y[i] = x[i] + 1.0f;")


def custom(x):
    return copy(inputs=[x], template=[("T", mx.float32)], grid=(256, 1, 1), threadgroup=(256, 1, 1),
                output_shapes=[x.shape], output_dtypes=[x.dtype])[0]


cases = {
    "add": lambda i: xs[i] + 1.0,
    "custom kernel": lambda i: custom(xs[i]),
    "sum": lambda i: xs[i].sum(),
    "matmul 64": lambda i: mats[i % 8] @ mats[(i + 1) % 8],
    "fused 3-op (compiled)": None,
}
fused = mx.compile(lambda x: mx.exp(x * 2.0 + 1.0))
cases["fused 3-op (compiled)"] = lambda i: fused(xs[i])
print(f"{N} independent tiny operations per graph, {mx.default_device()}; per operation:")
print(f"{'':24s} {'build us':>9s} {'dispatch us':>12s} {'wait us':>8s}")
for name, f in cases.items():
    t = []
    for rep in range(6):
        mx.synchronize()
        t0 = time.perf_counter()
        outs = [f(i) for i in range(N)]
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        mx.eval(outs)
        t3 = time.perf_counter()
        if rep:
            t.append((t1 - t0, t2 - t1, t3 - t2))
    med = [statistics.median(x[k] for x in t) / N * 1e6 for k in range(3)]
    print(f"{name:24s} {med[0]:9.2f} {med[1]:12.2f} {med[2]:8.2f}", flush=True)
