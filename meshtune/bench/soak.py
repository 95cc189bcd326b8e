"""`meshtune bench soak`: a long run must not grow its memory, and short runs must never hang.

One long 2-rank run with its memory checked, then repeated short 3-rank runs under a timeout;
prints PASS or FAIL. HELP, the command's --help, gives the thresholds; docs/reliability.md
("Long runs") holds the figures.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ..run_dir import METRICS_FILE
from ..training.metrics import read_metrics
from .faultkit import CLI, env
from .fit import Load, embedded_line
from .flags import BenchParser, COUNT

HELP = f"""`meshtune bench soak`: a long run must not grow its memory, and short runs must never hang.

    meshtune bench soak [--steps 2000] [--repeats 20] [--json]     # or: make soak

Part 1: one 2-rank run (`meshtune launch`, ring backend, embedded tiny model and
arithmetic data, global batch 8, LoRA, Adam) of `--steps` steps, reporting every
steps/40. Rank 0's reports carry mx.get_peak_memory() and mx.get_active_memory()
({METRICS_FILE}). After warm-up (the first 10% of steps) the peak must grow by less
than 5%, and the largest active memory of the last fifth of the run must be within
5% of the largest of the fifth right after warm-up (active memory at one report
depends on that step's batch width, so single samples are not compared).
Part 2: `--repeats` 3-rank runs of 10 steps, each under `meshtune launch --timeout`;
a run that needs the timeout is a hang. Prints a table and PASS or FAIL.
"""

LIMIT = 0.05
REPEAT_TIMEOUT_S = 120


def _train(n: int, out: Path, steps: int, report: int, timeout: float) -> tuple[int, float, str]:
    argv = [*CLI, "launch", "-n", str(n), "--timeout", str(timeout), "--", *CLI, "train", "--iters", str(steps),
            "--batch-size", "8" if n == 2 else "6", "--train.steps_per_report", str(report),
            "--steps-per-eval", "1000000", "--train.val_batches", "0", "--save-every", str(steps),
            "--runtime.watchdog_s", "30", "--adapter-path", str(out)]
    tic = time.monotonic()
    proc = subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=timeout + 60)
    return proc.returncode, time.monotonic() - tic, proc.stdout + proc.stderr


def memory_growth(records: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Peak and active memory growth after warm-up, from train reports."""
    train = [r for r in records if r["type"] == "train"]
    warm = max(steps // 10, train[0]["step"])
    after = [r for r in train if r["step"] >= warm]
    if len(after) < 3:
        raise ValueError(f"--steps {steps}: too few reports after warm-up to judge memory; use --steps 40 or more")
    fifth = max(len(after) // 5, 1)
    early, late = after[:fifth], after[-fifth:]
    peak0, peak1 = after[0]["peak_memory_gb"], after[-1]["peak_memory_gb"]
    act0 = max(r["active_memory_gb"] for r in early)
    act1 = max(r["active_memory_gb"] for r in late)
    return {"warmup_step": after[0]["step"], "peak_mb_after_warmup": peak0 * 1e3, "peak_mb_end": peak1 * 1e3,
            "peak_growth": peak1 / peak0 - 1, "active_mb_early": act0 * 1e3, "active_mb_late": act1 * 1e3,
            "active_growth": act1 / act0 - 1,
            "samples": [(r["step"], r["peak_memory_gb"] * 1e3, r["active_memory_gb"] * 1e3) for r in train]}


def main(argv: list[str]) -> int:
    p = BenchParser(prog="meshtune bench soak", description=HELP)
    p.add_argument("--steps", type=COUNT, default=2000, help="Steps of the long 2-rank run.")
    p.add_argument("--repeats", type=COUNT, default=20, help="Short 3-rank runs, each of which must not hang.")
    p.add_argument("--json", action="store_true", help="Print one JSON object last.")
    a = p.parse_args(argv)
    if a.steps < 40 or a.repeats < 1:
        raise ValueError(f"--steps {a.steps} --repeats {a.repeats}: need at least 40 steps and 1 repeat")
    print(embedded_line(8, 32, Load(processes=3)), flush=True)  # three ranks at most
    tic = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="meshtune-soak-") as tmp:
        report = max(a.steps // 40, 1)
        code, seconds, log = _train(2, Path(tmp) / "long", a.steps, report, timeout=max(60.0, a.steps * 2.0))
        if code != 0:
            raise RuntimeError(f"the {a.steps}-step run failed ({code}): {log[-2000:]}")
        mem = memory_growth(read_metrics(Path(tmp) / "long"), a.steps)
        finals = re.findall(r"\[rank (\d+)\] rank \d+ finished at step \d+ \(peak memory ([\d.]+) GB[,)]", log)
        runs = [_train(3, Path(tmp) / f"short{i}", 10, 5, timeout=REPEAT_TIMEOUT_S)[:2] for i in range(a.repeats)]
    hangs = sum(c == 124 for c, _ in runs)
    failures = sum(c not in (0, 124) for c, _ in runs)
    mem_ok = mem["peak_growth"] < LIMIT and mem["active_growth"] < LIMIT
    ok = mem_ok and hangs == 0 and failures == 0 and len(finals) == 2  # both ranks said they finished
    samples = mem["samples"]
    shown = samples[:: max(len(samples) // 10, 1)] + ([samples[-1]] if samples[-1] not in samples[::10] else [])
    print(f"soak 1: 2 ranks x {a.steps} steps in {seconds:.0f}s ({a.steps / seconds:.1f} steps/s), rank 0's reports")
    print(f"{'step':>6} | {'peak MB':>8} | {'active MB':>9}")
    print("\n".join(f"{s:>6} | {pk:8.3f} | {ac:9.3f}" for s, pk, ac in dict.fromkeys(shown)))
    print(f"peak after warm-up (step {mem['warmup_step']}) {mem['peak_mb_after_warmup']:.3f} MB -> end "
          f"{mem['peak_mb_end']:.3f} MB: {100 * mem['peak_growth']:+.2f}% (limit {100 * LIMIT:.0f}%)")
    print(f"largest active, fifth after warm-up {mem['active_mb_early']:.3f} MB -> last fifth "
          f"{mem['active_mb_late']:.3f} MB: {100 * mem['active_growth']:+.2f}% (limit {100 * LIMIT:.0f}%)")
    print("final peak per rank (as each rank printed it): " + ", ".join(f"rank {r} {g} GB" for r, g in finals))
    secs = [s for _, s in runs]
    print(f"soak 2: {a.repeats} x 3-rank 10-step runs (timeout {REPEAT_TIMEOUT_S}s each): "
          f"{a.repeats - hangs - failures} ok, {hangs} hangs, {failures} failures; seconds min "
          f"{min(secs):.1f} / median {statistics.median(secs):.1f} / max {max(secs):.1f}")
    print(f"soak {'PASS' if ok else 'FAIL'} in {time.monotonic() - tic:.0f}s")
    if a.json:
        mem.pop("samples")
        print(json.dumps({"memory": mem, "repeats": a.repeats, "hangs": hangs, "failures": failures,
                          "seconds": secs, "pass": ok}))
    return 0 if ok else 1
