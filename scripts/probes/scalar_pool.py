"""What reading a kernel input of 8 bytes or less costs on MLX's CUDA build, beside the same input padded.

Development probe (adapters issue): MLX's CUDA allocator keeps arrays of 8 bytes or less in one pool of
managed memory that the GPU reads across the bus (meshtune/cuda.py, kernel_constant). Times, interleaved
rep by rep in one process:
- m's and B's gradients for the 1B step's 112 layers (magnitude_grad_cuda, each layer its own g and y, a
  compiled call a shape as in a step), the kernels' constants padded (as meshtune does) and not;
- an Adam-shaped update (p - lr * g) over the step's 336 adapter and magnitude arrays, lr a 4-byte scalar
  (MLX's optimizers keep it so) and lr a view of a 16-byte array.
    python3 scripts/probes/scalar_pool.py [--reps 9]
Wall time is the host's where dispatch outruns the GPU (an H200 on a slow host: the pieces differed by
1% though ncu put the gradients' second launch at 0.39 against 1.94 ms). With --profile PIECE one
evaluation of that piece (1-4, in the order above) runs between cudaProfilerStart and Stop, for
`ncu --profile-from-start off` (gpu_tables.sh scalar-pool: step_kernels.py --summary sets the pairs side by side).
"""
import argparse
import statistics
import time

import mlx.core as mx

from meshtune import cuda
from meshtune.adapters import kernels as K

p = argparse.ArgumentParser()
p.add_argument("--reps", type=int, default=9)
p.add_argument("--tokens", type=int, default=4096)
p.add_argument("--profile", type=int, default=0, help="1-4: one evaluation of that piece under the CUDA profiler")
args = p.parse_args()
H, I, KV, R = 2048, 6144, 1024, 8
outs = [H, KV, KV, H, I, I, H] * 16
ins = [H, H, H, H, H, H, I] * 16
dt = mx.bfloat16


def grads_layer(out):
    d = dict(g=mx.random.normal((args.tokens, out)).astype(dt), y=mx.random.normal((args.tokens, out)).astype(dt),
             m=mx.random.uniform(1.0, 2.0, (out,)), norm=mx.random.uniform(1.0, 2.0, (out,)),
             p=mx.random.normal((R, out)).astype(dt))
    mx.eval(d)
    return d


layers = [grads_layer(o) for o in outs]


def magnitude_b(d):
    return K.magnitude_grad_cuda(d["g"], d["y"], d["m"], d["norm"], b_product=d["p"], b_scale=20.0)


def compiled_by_shape(pad_bytes):
    """A compiled magnitude_b a layer width, traced with KERNEL_CONSTANT_BYTES = pad_bytes."""
    fns = {}

    def run():
        saved = cuda.KERNEL_CONSTANT_BYTES
        cuda.KERNEL_CONSTANT_BYTES = pad_bytes
        try:
            res = []
            for d in layers:
                f = fns.setdefault(d["g"].shape[1], mx.compile(magnitude_b))
                res.extend(f(d))
            return res
        finally:
            cuda.KERNEL_CONSTANT_BYTES = saved
    return run


params = []
for o, i in zip(outs, ins):
    params += [(mx.zeros((i, R)), mx.ones((i, R))), (mx.zeros((R, o)), mx.ones((R, o))), (mx.zeros((o,)), mx.ones((o,)))]
mx.eval(params)
update = mx.compile(lambda p, g, lr: p - lr * g)
lr_scalar = mx.array(1e-3)  # 4 bytes: the small pool, as optim.Adam's learning rate
lr_padded = mx.array([1e-3, 0.0, 0.0, 0.0])[:1]  # a view of a 16-byte buffer
mx.eval(lr_scalar, lr_padded)


def adam_like(lr):
    return lambda: [update(p, g, lr) for p, g in params]


pieces = {
    "m's and B's gradients, constants padded (112 layers)": compiled_by_shape(16),
    "m's and B's gradients, constants of 4 bytes (112 layers)": compiled_by_shape(4),
    "p - lr * g, lr a 4-byte scalar (336 arrays)": adam_like(lr_scalar),
    "p - lr * g, lr a view of 16 bytes (336 arrays)": adam_like(lr_padded),
}
if args.profile:
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from step_kernels import cudart  # noqa: E402

    piece = list(pieces.values())[args.profile - 1]
    for _ in range(2):  # compiled, warm
        mx.eval(piece())
    mx.synchronize()
    rt = cudart()
    rt.cudaProfilerStart()
    mx.eval(piece())
    mx.synchronize()
    rt.cudaProfilerStop()
    raise SystemExit(0)
times = {k: [] for k in pieces}
for rep in range(args.reps + 1):
    for name, piece in pieces.items():
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(piece())
        mx.synchronize()
        if rep:  # the first round compiles
            times[name].append((time.perf_counter() - t) * 1e3)
print(f"{mx.default_device()}, tokens {args.tokens}, rank {R}; ms an evaluation, median of {args.reps} (rounds interleaved)")
for name, ts in times.items():
    print(f"  {name:62s} {statistics.median(ts):8.3f}")
