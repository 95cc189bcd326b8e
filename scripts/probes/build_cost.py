"""The host's time to build a compiled step's graph (the compiled call, before any evaluation), LoRA against DoRA,
on the CUDA code path traced on the CPU.

Development probe (adapters issue). On an H200 DoRA's step spent ~3.5 ms more than LoRA's in the compiled call
(probe_dora_step.py --host: "build"), before MLX dispatched a kernel. That call replays the traced graph, which does
not depend on the backend: here the CUDA kernels stand in as one node each (graph_nodes.py), the model is the 1B
bench's 16 layers at a small width, and each call is timed alone, then evaluated (untimed).
    cd scripts/probes && OPENBLAS_NUM_THREADS=1 python build_cost.py [--steps 200] [--layers 16] [--m-frozen]
(one BLAS thread: OpenBLAS's threads spin after each evaluation and take the timed call's core on a small machine).
On a 2-core CPU: LoRA 17-21 ms, DoRA 23-29 ms, with MESHTUNE_DORA_FOLD=0 as with auto. With --m-frozen also DoRA
with its magnitudes frozen (no m gradient, no m Adam: what m as a tensor a layer costs the build); session 31, merged
fold, `--steps 100 --m-frozen` on 2 cores: LoRA 8.25, DoRA 9.99, DoRA with m frozen 8.88 ms (m: ~2/3 of DoRA's extra).
"""
import argparse
import statistics
import time

import mlx.core as mx

import graph_nodes
from _steps import meshtune_step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--m-frozen", action="store_true", help="also DoRA with every m frozen")
    args = p.parse_args()
    graph_nodes.stand_in_cuda_kernels()
    from meshtune.bench import adapters as B
    from meshtune.bench.models import Shape

    a = B._settings(["--preset", "tiny"])
    shape = Shape(arch="qwen3", layers=args.layers, hidden=128, intermediate=384, heads=4, kv_heads=2, vocab=512)
    steps = {kind: meshtune_step(kind, a, shape, mx.bfloat16) for kind in ("lora", "dora")}
    if args.m_frozen:
        steps["dora, m frozen"] = meshtune_step("dora", a, shape, mx.bfloat16, frozen=["m"])
    times = {kind: [] for kind in steps}
    for i in range(args.steps + 3):
        for kind, (step, state, tokens, lengths) in steps.items():
            tic = time.perf_counter()
            out = step(tokens, lengths, None, None, True)
            built = time.perf_counter() - tic
            mx.eval(out[0], state)
            if i >= 3:
                times[kind].append(built)
    print(f"compiled call (graph built, nothing evaluated), {args.layers} layers, CUDA path, median of {args.steps}")
    for kind, ts in times.items():
        print(f"  {kind:<14} {statistics.median(ts) * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
