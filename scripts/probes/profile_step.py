"""A few overlapped 1B training steps of one kind, to run under a GPU profiler (ncu or nsys).

Development probe (adapters issue): DoRA's overlapped step on an H200 carries ~1.9 ms of
GPU time per 1024 tokens over LoRA's, and the pieces timed alone explain about half of it
(docs/bench/overlapped_batches_h200.txt). Under `nsys profile --cuda-graph-trace=node` this
gives every kernel's time in the step; scripts/probes/kernel_diff.py sets LoRA's beside DoRA's.
    nsys profile -t cuda,nvtx --cuda-graph-trace=node -o step_dora python3 profile_step.py --kind dora
It calls cudaProfilerStart/Stop around the timed steps where the CUDA runtime can be loaded
(ncu --profile-from-start off, nsys --capture-range=cudaProfilerApi): gpu_tables.sh profile
runs it under ncu, each launch timed alone, and kernel_diff.py --cycle takes one step from it.
"""
import argparse
import ctypes
import ctypes.util
import time

import mlx.core as mx

from _steps import meshtune_step
from meshtune.bench import adapters as B
from meshtune.train import OneInFlight


def _cudart():
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", ctypes.util.find_library("cudart")):
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kind", choices=["lora", "dora"], required=True)
    p.add_argument("--base", choices=["bf16", "4bit"], default="bf16")
    p.add_argument("--preset", default="1b")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5, help="Steps before the timed ones (the first compiles).")
    args = p.parse_args()
    a = B._settings(["--preset", args.preset] + (["--batch-size", str(args.batch_size)] if args.batch_size else []))
    dtype = mx.float32 if B._on_cpu() else mx.bfloat16
    step, state, tokens, lengths = meshtune_step(args.kind, a, B.shape_of(a), dtype, quantized=args.base == "4bit")
    for _ in range(args.warmup):
        ce, n, _, _ = step(tokens, lengths, None, None, True)
        mx.eval(state, ce, n)
    cudart = _cudart()
    if cudart is not None:
        cudart.cudaProfilerStart()
    tic, in_flight = time.perf_counter(), OneInFlight(True)
    for _ in range(args.steps):  # overlapped, as the loop takes steps on a GPU (runtime.overlap_steps)
        ce, n, _, _ = step(tokens, lengths, None, None, True)
        in_flight.run([state, ce, n], [ce])
    in_flight.finish()
    ms = (time.perf_counter() - tic) / args.steps * 1e3
    if cudart is not None:
        cudart.cudaProfilerStop()
    print(f"{args.kind} {args.base}: batch {a.batch_size} x {a.seq_len}, {args.steps} overlapped steps, {ms:.2f} ms a step"
          + ("" if cudart is not None else " (no CUDA runtime found: the whole run is profiled)"))


if __name__ == "__main__":
    main()
