"""`meshtune bench pipeline`: naive vs GPipe vs 1F1B at P stages for several micro-batch counts.

Every configuration is `meshtune train --parallel.pp P` started by `meshtune launch
--pin` (one core and one BLAS thread per rank) on the embedded model, the same global
batch and step count; tokens/s comes from rank 0's report windows after the first.
Beside it: the ideal pipeline efficiency m / (m + p - 1) and the measured one
(tokens/s over the naive schedule's, which keeps one stage busy at a time), and each
stage's peak memory as MLX reports it.

    meshtune bench pipeline [--stages 2] [--iters 30] [--batch-size 16] [--json]
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import tempfile
from pathlib import Path

from ..blas import describe_blas
from ..launch import launch_local
from .peer import metric_windows, steps_per_sec

SCHEDULE_NAMES = ("naive", "gpipe", "1f1b")


def _run(schedule: str, stages: int, micro: int, a: argparse.Namespace, out: Path) -> tuple[float, list[float]]:
    """(steps/s, peak GB per stage) of one configuration."""
    cmd = [sys.executable, "-m", "meshtune.cli", "train", "--iters", str(a.iters), "--batch-size", str(a.batch_size),
           "--parallel.pp", str(stages), "--parallel.schedule", schedule, "--parallel.micro_batches", str(micro),
           "--fine-tune-type", a.fine_tune_type, "--num-layers", "-1", "--learning-rate", "1e-4",
           "--train.steps_per_report", str(max(a.iters // 3, 1)), "--train.val_batches", "0",
           "--save-every", str(a.iters), "--adapter-path", str(out)]
    log = io.StringIO()
    code = launch_local(stages, cmd, pin=True, out=log)
    if code:
        raise RuntimeError(f"{schedule} M={micro} failed with exit code {code}:\n{log.getvalue()[-3000:]}")
    peaks = [float(m.group(2)) for m in sorted(re.finditer(r"\[rank (\d+)\] .*peak memory ([\d.]+) GB", log.getvalue()),
                                                   key=lambda m: int(m.group(1)))]
    return steps_per_sec(metric_windows(out)), peaks


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="meshtune bench pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2, help="Pipeline stages (ranks).")
    p.add_argument("--micro-batches", default="2,4,8", help="Comma-separated micro-batch counts.")
    p.add_argument("--iters", type=int, default=30, help="Optimizer steps per run.")
    p.add_argument("--batch-size", type=int, default=16, help="Global batch (divisible by every M).")
    p.add_argument("--fine-tune-type", default="lora", help="lora, dora or full.")
    p.add_argument("--json", action="store_true", help="Print one JSON object last.")
    a = p.parse_args(argv)
    ms = [int(m) for m in a.micro_batches.split(",")]
    rows, result = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in ms:
            naive_rate = None
            for name in SCHEDULE_NAMES:
                rate, peaks = _run(name, a.stages, m, a, Path(tmp) / f"{name}-{m}")
                naive_rate = rate if name == "naive" else naive_rate
                rows.append((m, name, rate, rate / naive_rate, peaks))
                result[f"{name}_steps_per_s_m{m}"] = rate
                result[f"peak_gb_{name}_m{m}"] = peaks
                if name != "naive":
                    result[f"{name}_over_naive_m{m}"] = rate / naive_rate
    mlast = ms[-1]
    gp, ob = result[f"peak_gb_gpipe_m{mlast}"], result[f"peak_gb_1f1b_m{mlast}"]
    result["peak_mem_1f1b_over_gpipe"] = max(ob) / max(gp) if gp and ob else float("nan")
    print(f"pipeline benchmark: {a.stages} stages, embedded tiny model, {a.fine_tune_type}, global batch "
          f"{a.batch_size}, {a.iters} steps; meshtune launch --pin (one core per rank, OPENBLAS_NUM_THREADS=1); "
          f"{describe_blas()}")
    print(f"{'M':>3} {'schedule':<8}{'steps/s':>10}{'vs naive':>10}{'ideal':>8}   peak GB per stage")
    for m, name, rate, speed, peaks in rows:
        ideal = (m / (m + a.stages - 1)) / (1 / a.stages) if name != "naive" else 1.0
        print(f"{m:>3} {name:<8}{rate:>10.2f}{speed:>9.2f}x{ideal:>7.2f}x   {', '.join(f'{x:.4f}' for x in peaks)}")
    if a.json:
        print(json.dumps(result))
    return 0
