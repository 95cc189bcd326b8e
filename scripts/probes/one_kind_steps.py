"""The bench's meshtune step of one kind alone, for a host profiler (nsys) to attribute its host time.

Development probe (adapters issue): MLX's CUDA build marks each primitive's eval_gpu with an NVTX range,
so `nsys profile -t nvtx,cuda` of this process, one kind a process, gives each primitive's count and host
time a step; LoRA's beside DoRA's shows where DoRA's extra host time goes.

    python3 scripts/probes/one_kind_steps.py --kind dora [--base bf16] [--steps 30]
"""
import argparse
import time

import mlx.core as mx

from meshtune.adapters import set_base_path
from meshtune.bench import adapters as B

ap = argparse.ArgumentParser()
ap.add_argument("--kind", choices=["lora", "dora"], required=True)
ap.add_argument("--base", choices=["bf16", "4bit"], default="bf16")
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--preset", default="1b")
args = ap.parse_args()
a = B._settings(["--preset", args.preset])
set_base_path(a.base_path)
shape = B.shape_of(a)
dtype = B.DTYPES[B.dense_dtype_name(a)]
run = B.build_step("meshtune", args.kind, args.base, a, shape, dtype)
for _ in range(a.warmup):
    run()
run.finish()
tic = time.perf_counter()
for _ in range(args.steps):
    run()
run.finish()
print(f"{args.kind} {args.base}: {(time.perf_counter() - tic) / args.steps * 1e3:.2f} ms a step over {args.steps} steps",
      flush=True)
