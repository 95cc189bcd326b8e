"""Does building and dispatching step N+1 while the GPU runs step N shorten the step?

Development probe (adapters issue): python scripts/probes/overlapped_steps.py [--bases bf16,4bit] [--steps 60] [--batch-size 8]
A step waited for before the next is built leaves the GPU idle while the host builds and
dispatches the next one (scripts/probes/dispatch_cost.py: a 1B LoRA step is ~5 ms of
building and ~30 ms of dispatch beside ~50 ms in all). Overlapped, a step takes the longer
of the host's time and the GPU's. For meshtune LoRA and DoRA it times, in interleaved
rounds: steps one after another (as bench adapters and the loop take them today), steps
overlapped one deep, and the host's part of an overlapped step (building + dispatching).
"""
import argparse
import statistics
import time

import mlx.core as mx

from _steps import meshtune_step
from meshtune.bench import adapters as B


def runners(kind, base, a, shape, dtype):
    step, state, tokens, lengths = meshtune_step(kind, a, shape, dtype, quantized=base == "4bit")
    pending = []

    def sequential():
        tic = time.perf_counter()
        ce, n, _, _ = step(tokens, lengths, None, None, True)
        mx.eval(state, ce, n)
        return time.perf_counter() - tic, 0.0

    def overlapped():
        tic = time.perf_counter()
        ce, n, _, _ = step(tokens, lengths, None, None, True)
        mx.async_eval(state, ce, n)
        host = time.perf_counter() - tic
        if pending:
            mx.eval(pending.pop())
        pending.append(ce)
        return time.perf_counter() - tic, host

    def drain():
        while pending:
            mx.eval(pending.pop())

    return sequential, overlapped, drain


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="1b")
    p.add_argument("--bases", default="bf16,4bit")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=None, help="Default: the preset's.")
    args = p.parse_args()
    a = B._settings(["--preset", args.preset] + (["--batch-size", str(args.batch_size)] if args.batch_size else []))
    shape = B.shape_of(a)
    dtype = mx.float32 if B._on_cpu() else mx.bfloat16
    configs = {f"{k} {b}": runners(k, b, a, shape, dtype) for b in args.bases.split(",") for k in ("lora", "dora")}
    for seq, ovl, drain in configs.values():
        for _ in range(3):
            seq()
        for _ in range(3):
            ovl()
        drain()
    times = {name: {"sequential": [], "overlapped": [], "host": []} for name in configs}
    per = max(1, args.steps // args.rounds)
    for _ in range(args.rounds):
        for name, (seq, ovl, drain) in configs.items():
            times[name]["sequential"] += [seq()[0] for _ in range(per)]
            ovl()  # one step in flight before the timed ones
            for _ in range(per):
                t, host = ovl()
                times[name]["overlapped"].append(t)
                times[name]["host"].append(host)
            drain()
    print(f"{args.preset}, batch {a.batch_size} x {a.seq_len}, {per * args.rounds} steps each in {args.rounds} rounds, "
          f"{mx.default_device()}: median ms a step")
    print(f"{'':12s} {'sequential':>11s} {'overlapped':>11s} {'host part':>10s}")
    for name, t in times.items():
        med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
        print(f"{name:12s} {med['sequential']:11.2f} {med['overlapped']:11.2f} {med['host']:10.2f}", flush=True)
    for b in args.bases.split(","):
        s = {k: statistics.median(times[f'dora {b}'][k]) / statistics.median(times[f'lora {b}'][k])
             for k in ("sequential", "overlapped")}
        print(f"DoRA/LoRA {b}: sequential {s['sequential']:.3f}x, overlapped {s['overlapped']:.3f}x")


if __name__ == "__main__":
    main()
