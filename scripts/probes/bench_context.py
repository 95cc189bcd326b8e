"""Whether meshtune's DoRA/LoRA step ratio depends on what the bench times beside it.

Development probe (adapters issue): on one H200 machine probe_dora_step.py (LoRA and DoRA alone,
interleaved) gave DoRA/LoRA 1.07-1.09x bf16 with LoRA at ~41 ms, and `meshtune bench adapters`
minutes later 1.19x with LoRA at 50.8 ms (docs/bench/adapters_h200_25.txt). The bench interleaves
all eight configurations, stock mlx-lm's among them (its step clears MLX's allocator cache after
every step, as mlx_lm.lora's loop does). Here the bench's eight steps are built once, as the bench
builds them, and timed in phases, each its own interleaved rounds over a subset:

    all eight (the bench) | meshtune's four | meshtune's bf16 pair | stock's and meshtune's bf16 four

twice over, in that order. Each phase prints meshtune's medians and DoRA/LoRA per base.

    python3 scripts/probes/bench_context.py [--preset 1b] [--steps 60] [--rounds 6] [--cycles 2]
"""
import argparse
import sys

import mlx.core as mx

from meshtune.adapters import set_base_path
from meshtune.bench import adapters as B
from meshtune.heap import keep_freed_memory

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="1b")
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--rounds", type=int, default=6)
ap.add_argument("--cycles", type=int, default=2)
args = ap.parse_args()
a = B._settings(["--preset", args.preset, "--steps", str(args.steps), "--rounds", str(args.rounds)])
a.keep_freed_memory = a.keep_freed_memory and keep_freed_memory()
set_base_path(a.base_path)
shape = B.shape_of(a)
dtype = B.DTYPES[B.dense_dtype_name(a)]
configs = [(impl, kind, base) for base in B.BASES for kind in B.KINDS for impl in B.IMPLS]
steps = {f"{i}_{k}_{b}": B.build_step(i, k, b, a, shape, dtype) for i, k, b in configs}
PHASES = {
    "all eight (the bench)": list(steps),
    "meshtune's four": [k for k in steps if k.startswith("meshtune")],
    "meshtune's bf16 pair": ["meshtune_lora_bf16", "meshtune_dora_bf16"],
    "stock's and meshtune's bf16 four": [k for k in steps if k.endswith("bf16")],
}
print(f"{args.steps} steps in {args.rounds} rounds a phase, {a.warmup} warm-up steps a configuration a phase", flush=True)
for cycle in range(args.cycles):
    for phase, names in PHASES.items():
        ms = {k: v * 1e3 for k, v in B.time_steps({k: steps[k] for k in names}, a).items()}
        line = "  ".join(f"{k.removeprefix('meshtune_')} {v:.1f}" for k, v in ms.items() if k.startswith("meshtune"))
        ratios = [f"{b} {ms[f'meshtune_dora_{b}'] / ms[f'meshtune_lora_{b}']:.3f}x" for b in B.BASES
                  if f"meshtune_dora_{b}" in ms]
        print(f"cycle {cycle + 1} {phase:<34} DoRA/LoRA {', '.join(ratios):<24} meshtune ms: {line}", flush=True)
sys.exit(0)
