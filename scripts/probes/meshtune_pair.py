"""Two of the bench's meshtune steps alone, interleaved step by step for many rounds, and their ratio.

Development probe (adapters issue): on two CPU cores one step of the 1B model moves by +-10% from
one call to the next, so the bench's CPU invocation (2 x 2 timed steps a configuration, the peer's
4-bit LoRA taking 150 s a step) scatters its DoRA / LoRA ratio by more than DoRA's extra work.
Without the peer, many more rounds fit in a few minutes:

    python scripts/probes/meshtune_pair.py --pair lora:4bit,dora:4bit --rounds 8 \
        --preset 1b --batch-size 1 --seq-len 128
"""
import argparse
import statistics
import time

from _steps import interleaved

from meshtune.adapters import set_base_path
from meshtune.bench import adapters as B

ap = argparse.ArgumentParser()
ap.add_argument("--pair", default="lora:4bit,dora:4bit", help="two KIND:BASE, KIND lora|dora, BASE bf16|4bit")
ap.add_argument("--rounds", type=int, default=8)
args, bench_flags = ap.parse_known_args()
a = B._settings(bench_flags)
set_base_path(a.base_path)
shape = B.shape_of(a)
dtype = B.DTYPES[B.dense_dtype_name(a)]
names = args.pair.split(",")


def timed(run):
    """One call of the bench's step, waited for, in ms."""
    def call():
        tic = time.perf_counter()
        run()
        run.finish()
        return (time.perf_counter() - tic) * 1e3
    return call


runs = {name: timed(B.build_step("meshtune", *name.split(":"), a, shape, dtype)) for name in names}
times = interleaved(runs, args.rounds, warmup=max(a.warmup, 2), rounds=args.rounds)
for i in range(args.rounds):
    print(f"round {i}: " + ", ".join(f"{n} {t[i]:.0f} ms" for n, t in times.items()))
medians = {name: statistics.median(t) for name, t in times.items()}
per_round = [times[names[1]][i] / times[names[0]][i] for i in range(args.rounds)]
print("median ms/step: " + ", ".join(f"{n} {m:.1f}" for n, m in medians.items()))
print(f"{names[1]} / {names[0]}: {medians[names[1]] / medians[names[0]]:.3f}x on the medians "
      f"(rounds {min(per_round):.2f}-{max(per_round):.2f}x)")
