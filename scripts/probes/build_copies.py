"""Whether one process's models of the same code differ in the host's build time (the compiled call), on the CPU
with the CUDA path stubbed (step_graph.py's stand-ins): three models each of LoRA and DoRA, 16 blocks at a small
width, timed in 8 interleaved rounds of 10 calls; each model's median, least and most ms a call.

Development probe (adapters issue): python scripts/probes/build_copies.py
"""
import os
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.dirname(__file__))
from _steps import interleaved, meshtune_step  # noqa: E402
from step_graph import Batch, stub_cuda  # noqa: E402


def main():
    shape = stub_cuda(16)
    runs = {}
    for copy in range(3):
        for kind in ("lora", "dora"):
            step, state, tokens, lengths = meshtune_step(kind, Batch, shape, mx.float32)

            def run(step=step, state=state, tokens=tokens, lengths=lengths):
                """ms a call of the compiled step (the build), over 10 calls; then the calls evaluated."""
                tic = time.perf_counter()
                for _ in range(10):
                    ce, n, _, _ = step(tokens, lengths, None, None, True)
                ms = (time.perf_counter() - tic) / 10 * 1e3
                mx.eval(state, ce, n)
                return ms
            runs[f"{kind}{copy}"] = run
    for name, times in interleaved(runs, 8, rounds=8).items():
        print(f"{name} build ms median {statistics.median(times):.2f}  min {min(times):.2f} max {max(times):.2f}")


if __name__ == "__main__":
    main()
