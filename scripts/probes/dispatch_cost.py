"""Is the training step bound by the host's dispatch (encoding kernels) or by the GPU?

Development probe (adapters issue). For meshtune LoRA and DoRA on the bench's model it
times, per step: building the lazy graph (the compiled call), `mx.async_eval` (on a GPU
stream MLX encodes every kernel on the calling thread, so this is the host's dispatch
time) and the wait for the result. If dispatch is close to the whole step, the step is
host-bound and extra small ops cost their launch, not their arithmetic.

    python scripts/probes/dispatch_cost.py [--preset 1b] [--bases bf16] [--batch-size 4] [--steps 8]
Run it under different MLX_MAX_OPS_PER_BUFFER / MLX_USE_CUDA_GRAPHS settings to compare.
"""
import argparse
import os
import statistics
import time

import mlx.core as mx

from _steps import interleaved, meshtune_step
from meshtune.bench import adapters as B


def runner(kind: str, base: str, a, shape, dtype):
    step, state, tokens, lengths = meshtune_step(kind, a, shape, dtype, quantized=base == "4bit")

    def run():
        t0 = time.perf_counter()
        ce, n, _, _ = step(tokens, lengths, None, None, True)
        t1 = time.perf_counter()
        mx.async_eval(state, ce, n)
        t2 = time.perf_counter()
        mx.eval(state, ce, n)
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, t3 - t0

    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="1b")
    p.add_argument("--bases", default="bf16")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--label", default="")
    args = p.parse_args()
    a = B._settings(["--preset", args.preset] + (["--batch-size", str(args.batch_size)] if args.batch_size else [])
                    + (["--seq-len", str(args.seq_len)] if args.seq_len else []))
    shape = B.shape_of(a)
    dtype = mx.float32 if B._on_cpu() else mx.bfloat16
    env = {k: os.environ[k] for k in ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER", "MLX_USE_CUDA_GRAPHS",
                                      "MLX_CUDA_GRAPH_CACHE_SIZE") if k in os.environ}
    print(f"# {args.label} batch {a.batch_size}x{a.seq_len} env {env or 'default'}", flush=True)
    runs = {f"{k} {b}": runner(k, b, a, shape, dtype) for b in args.bases.split(",") for k in ("lora", "dora")}
    times = interleaved(runs, args.steps)
    print(f"{'':12s} {'build ms':>9s} {'dispatch ms':>12s} {'wait ms':>8s} {'step ms':>8s}")
    for name, t in times.items():
        med = [statistics.median(x[i] for x in t) * 1e3 for i in range(4)]
        print(f"{name:12s} {med[0]:9.1f} {med[1]:12.1f} {med[2]:8.1f} {med[3]:8.1f}", flush=True)


if __name__ == "__main__":
    main()
