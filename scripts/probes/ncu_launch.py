"""One folded norm launch and one layer's m-and-B gradient launch, for Nsight Compute's sections.

Development probe (adapters issue): why DoRA's kernels move their bytes at 1-2 TB/s on an H200
(scripts/probes/folded_launch_shapes.py, dora_kernel_cost.py). Warms both up, then brackets one
of each with cudaProfilerStart/Stop:
    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section LaunchStats python3 scripts/probes/ncu_launch.py [--out 6144 --in 2048]
"""
import argparse
import os
import sys

import mlx.core as mx

sys.path.insert(0, os.path.dirname(__file__))
from step_kernels import cudart  # noqa: E402

from meshtune.adapters import kernels as K  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", type=int, default=6144)
p.add_argument("--in", dest="inp", type=int, default=2048)
p.add_argument("--layers", type=int, default=32)
p.add_argument("--tokens", type=int, default=4096)
args = p.parse_args()
ws = [(mx.random.normal((args.out, args.inp)) * args.inp ** -0.5).astype(mx.bfloat16) for _ in range(args.layers)]
a = [mx.random.normal((args.inp, 8)) * 0.02 for _ in ws]
b = [mx.random.normal((8, args.out)) * 0.01 for _ in ws]
m = [mx.ones((args.out,)) for _ in ws]
g, y = (mx.random.normal((args.tokens, args.out)).astype(mx.bfloat16) for _ in range(2))
mx.eval(ws, a, b, m, g, y)


def both():
    outs = K.row_norms_and_scaled_cuda(ws, a, b, [20.0] * len(ws), m, factors=K.writes_factors(), stacked=True)
    grads = K.magnitude_grad_cuda(g, y, m[0], outs[0][0], b_product=b[0].astype(mx.bfloat16), b_scale=20.0)
    mx.eval([x for part in outs[1:] for x in part], outs[0][0].launch, grads)


both()
mx.synchronize()
rt = cudart()
rt.cudaProfilerStart()
both()
mx.synchronize()
rt.cudaProfilerStop()
