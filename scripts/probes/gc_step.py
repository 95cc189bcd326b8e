"""Whether Python's garbage collector costs meshtune's training step host time: LoRA and DoRA steps
of the bench's 1B model (bf16 on a GPU, float32 elsewhere) with the collector on (Python's default),
frozen after set-up (gc.freeze: what exists is never scanned again) and off, interleaved in rounds in
one process. The step is limited by the host on an H200 (docs/bench/dora_m_training_h200.txt), so any
time the collector takes shows in it.

    python3 scripts/probes/gc_step.py [--preset 1b] [--steps 60] [--rounds 6]
"""
import argparse
import gc
import statistics
import time

import mlx.core as mx

from meshtune.bench import adapters as B

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="1b")
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--rounds", type=int, default=6)
args = ap.parse_args()
a = B._settings(["--preset", args.preset])  # the bench's settings for the preset: shape, batch, overlap
shape = B.shape_of(a)
dtype = mx.float32 if B._on_cpu() else mx.bfloat16
steps = {k: B.build_step("meshtune", k, "bf16", a, shape, dtype) for k in ("lora", "dora")}
for s in steps.values():
    for _ in range(3):
        s()
    s.finish()
modes = {"gc on": gc.enable, "gc frozen": lambda: (gc.collect(), gc.freeze()), "gc off": gc.disable}
times = {(m, k): [] for m in modes for k in steps}
collections = {m: 0 for m in modes}
per = max(1, args.steps // args.rounds)
for _ in range(args.rounds):
    for m, setup in modes.items():
        setup()
        before = sum(s["collections"] for s in gc.get_stats())
        for k, s in steps.items():
            for _ in range(per):
                tic = time.perf_counter()
                s()
                times[(m, k)].append(time.perf_counter() - tic)
            s.finish()
        collections[m] += sum(s["collections"] for s in gc.get_stats()) - before
        gc.unfreeze()
        gc.enable()
print(f"{args.preset}: device {mx.default_device()}, batch {a.batch_size} x {a.seq_len}, {args.steps} steps a kind "
      f"and mode in {args.rounds} interleaved rounds; median ms a step")
for m in modes:
    lo, do = (statistics.median(times[(m, k)]) * 1e3 for k in ("lora", "dora"))
    print(f"  {m:10s} LoRA {lo:7.2f}  DoRA {do:7.2f}  DoRA/LoRA {do / lo:.3f}   collections {collections[m]}")
print(f"objects the collector tracks: {len(gc.get_objects())}; thresholds {gc.get_threshold()}")
