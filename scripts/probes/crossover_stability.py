"""Does the start-up measurement of the quantized/dense crossover give the same answer twice?

Development probe (adapters issue). `auto` picks each quantized layer's base path from
`measure_crossover`, once per process; a noisy measurement moves a 4-bit step's time from
run to run. This measures the bench model's five shapes `--times` times over and prints
each result, so a change in the measurement can be judged by its spread.

    python scripts/probes/crossover_stability.py [--times 3] [--bits 4] [--group-size 64]
"""
import argparse
import time

import mlx.core as mx

from meshtune.adapters.base_path import NEVER, measure_crossover

SHAPES = ((6144, 2048), (2048, 6144), (2048, 2048), (1024, 2048), (32000, 2048))  # the 1b preset's (out, in)

p = argparse.ArgumentParser()
p.add_argument("--times", type=int, default=3)
p.add_argument("--bits", type=int, default=4)
p.add_argument("--group-size", type=int, default=64)
a = p.parse_args()
dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
print(f"{mx.default_device()}, {dtype}, {a.bits}-bit group {a.group_size}: tokens from which dequantize + dense wins")
for t in range(a.times):
    start = time.perf_counter()
    got = [measure_crossover(o, i, bits=a.bits, group_size=a.group_size, dtype=dtype) for o, i in SHAPES]
    cells = ", ".join(f"{o}x{i}: {'never' if c == NEVER else c}" for (o, i), c in zip(SHAPES, got))
    print(f"  run {t + 1} ({time.perf_counter() - start:.1f} s): {cells}", flush=True)
