"""LoRA's and DoRA's 1B steps with mlx's Adam against multi_adam's grouped update, in one process.

Development probe (adapters issue), for MLX's CUDA build (off CUDA both are mlx's Adam):
    python scripts/probes/adam_paths.py [--bases bf16] [--copies 2] [--host] [bench adapters flags]
Each configuration is its own model (copies of each, since one process's models differ in host time),
timed in interleaved rounds as `meshtune bench adapters` times them; --host splits each step into the
compiled call (build), mx.async_eval (dispatch) and the wait for the step before. Last, the main thread's
CPU time a step in user and in kernel mode (/proc's thread counters, summed over every call): time in the
kernel is the driver's (ioctl) and the memory manager's (mmap, page faults).
"""
import argparse
import os
import statistics
import sys
import threading
from pathlib import Path

import mlx.core as mx

from meshtune import multi_adam
from meshtune.bench import adapters as B

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from probe_dora_step import _HostTimes  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _thread_cpu() -> tuple[float, float]:
    """This thread's (user, system) CPU seconds so far."""
    with open(f"/proc/self/task/{threading.get_native_id()}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


class _CpuTimes:
    """Each configuration's main-thread user and system seconds over its timed calls, and the calls."""

    def __init__(self):
        self.spent: dict[str, list[float]] = {}

    def timed(self, name, run):
        u, s = _thread_cpu()
        out = run()
        u2, s2 = _thread_cpu()
        got = self.spent.setdefault(name, [0.0, 0.0, 0])
        got[0] += u2 - u
        got[1] += s2 - s
        got[2] += 1
        return out

    def report(self):
        print("main thread's CPU ms a step (all calls, warm-up included)   user  system")
        for name, (u, s, n) in self.spent.items():
            print(f"  {name:<28} {u / n * 1e3:8.2f} {s / n * 1e3:8.2f}", flush=True)
        self.spent.clear()


def _built(kind, base, a, shape, dtype, grouped):
    """A step of `kind`, traced (at its first call) with the grouped Adam update (as MESHTUNE_MULTI_ADAM=1)
    or with mlx's."""
    enabled, multi_adam.ENABLED = multi_adam.ENABLED, grouped
    try:
        run = B.build_step("meshtune", kind, base, a, shape, dtype)
        run()
    finally:
        multi_adam.ENABLED = enabled
    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bases", default="bf16")
    p.add_argument("--copies", type=int, default=2)
    p.add_argument("--host", action="store_true")
    args, rest = p.parse_known_args()
    a = B._settings(["--preset", "1b", *rest])
    shape, dtype = B.shape_of(a), (mx.float32 if B._on_cpu() else mx.bfloat16)
    host = _HostTimes() if args.host else None
    cpu = _CpuTimes()
    print(f"multi_adam's CUDA path here: {multi_adam.on_cuda()}", flush=True)
    for base in args.bases.split(","):
        steps, kinds = {}, {}
        for copy in range(args.copies):
            for kind in ("lora", "dora"):
                for grouped in (False, True):
                    name = f"{kind} {'multi_adam' if grouped else 'mlx Adam'} #{copy + 1}"
                    run = _built(kind, base, a, shape, dtype, grouped)
                    hosted = (lambda run=run, name=name: host.timed(name, run)) if host else run
                    timed = (lambda hosted=hosted, name=name: cpu.timed(name, hosted))
                    timed.finish = run.finish
                    steps[name], kinds[name] = timed, name.rsplit(" #", 1)[0]
        ms = B.time_steps(steps, a)
        print(f"{base}: batch {a.batch_size} x {a.seq_len}, {a.steps} steps in {a.rounds} rounds, {args.copies} models each")
        for name, v in ms.items():
            print(f"  {name:<28} {v * 1e3:8.2f} ms")
        pooled: dict[str, list[float]] = {}
        for name, v in ms.items():
            pooled.setdefault(kinds[name], []).append(v)
        lora = statistics.median(pooled["lora mlx Adam"])
        for kind, vs in pooled.items():
            print(f"  median {kind:<21} {statistics.median(vs) * 1e3:8.2f} ms  {statistics.median(vs) / lora:5.3f}x "
                  f"LoRA with mlx Adam  ({min(vs) * 1e3:.2f}-{max(vs) * 1e3:.2f})", flush=True)
        if host:
            host.report(base)
        cpu.report()
        del steps
        B._release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
