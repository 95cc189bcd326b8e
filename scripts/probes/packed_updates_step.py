"""The step with the optimizer's small-parameter updates packed up to each size limit, LoRA and DoRA.

Development probe (adapters issue): meshtune.optimizers.PackedUpdates updates every float32
parameter of at most PACK_MAX_ELEMENTS elements as one packed vector. 0 is the plain
optimizer (a launch a parameter); 8192 packs DoRA's magnitudes (a vector a layer); 1 << 20
packs LoRA's factors too. Timed in interleaved rounds, median ms a step.
    python3 scripts/probes/packed_updates_step.py [--preset 1b] [--steps 120] [--rounds 12] [--limits 0,8192,1048576]
"""
import argparse
import statistics
import time

import mlx.core as mx

import meshtune.optimizers as O
from _steps import interleaved, meshtune_step
from meshtune.bench import adapters as B


def runner(kind, limit, a, shape, dtype):
    O.PACK_MAX_ELEMENTS = limit  # read when the step is traced, at its first call
    step, state, tokens, lengths = meshtune_step(kind, a, shape, dtype)

    def run():
        O.PACK_MAX_ELEMENTS = limit
        tic = time.perf_counter()
        ce, n, _, _ = step(tokens, lengths, None, None, True)
        mx.eval(state, ce, n)
        return time.perf_counter() - tic

    run()
    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="1b")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--limits", default="0,8192,1048576")
    args = p.parse_args()
    a = B._settings(["--preset", args.preset])
    shape = B.shape_of(a)
    dtype = mx.float32 if B._on_cpu() else mx.bfloat16
    runs = {(kind, int(limit)): runner(kind, int(limit), a, shape, dtype)
            for kind in ("lora", "dora") for limit in args.limits.split(",")}
    times = interleaved(runs, args.steps, rounds=args.rounds)
    print(f"# {args.preset}, batch {a.batch_size} x {a.seq_len}, {args.steps} steps in {args.rounds} rounds, {mx.default_device()}")
    print(f"{'pack limit':>10s} {'LoRA ms':>9s} {'DoRA ms':>9s} {'DoRA/LoRA':>10s}")
    for limit in args.limits.split(","):
        lora, dora = (statistics.median(times[(k, int(limit))]) * 1e3 for k in ("lora", "dora"))
        print(f"{int(limit):10d} {lora:9.2f} {dora:9.2f} {dora / lora:10.3f}", flush=True)


if __name__ == "__main__":
    main()
