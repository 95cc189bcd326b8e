"""`meshtune bench scaling`: 1 rank vs N ranks, gradient sync after the backward vs overlapped.

Weak scaling: every rank keeps the same local batch, so N ranks process N times the
tokens per step; efficiency = (N-rank tokens/s) / (N x 1-rank tokens/s). Each
configuration runs through `meshtune launch --pin` (one core and one BLAS thread per
rank, so 1 rank and N ranks get the same compute per rank). Exposed communication is
the N-rank step time minus the 1-rank step time (the compute-only step of the same
local batch). Runs on plain loopback; the shaped-link namespaces of issue 4 are not
built yet.

    meshtune bench scaling [--ranks 2] [--iters 60] [--local-batch 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from ..blas import describe_blas
from .peer import metric_windows, run_command, steps_per_sec


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshtune bench scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="Ranks of the multi-rank runs.")
    p.add_argument("--iters", type=int, default=60, help="Optimizer steps per run.")
    p.add_argument("--local-batch", type=int, default=8, help="Examples per rank per step.")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="Gradient bucket size.")
    p.add_argument("--json", action="store_true", help="Print one JSON object last.")
    return p


def _run(ranks: int, kind: str, sync: str, a: argparse.Namespace, out: Path) -> float:
    """Steps/s of one configuration (windows after the first)."""
    train = ["-m", "meshtune.cli", "train", "--iters", str(a.iters), "--batch-size", str(a.local_batch * ranks),
             "--fine-tune-type", kind, "--num-layers", "-1", "--learning-rate", "1e-4",
             "--train.steps_per_report", str(max(a.iters // 4, 1)), "--train.val_batches", "0",
             "--save-every", str(a.iters), "--parallel.grad_sync", sync, "--parallel.bucket_mb",
             str(a.bucket_mb), "--adapter-path", str(out)]
    cmd = [sys.executable, "-m", "meshtune.cli", "launch", "-n", str(ranks), "--pin", "--",
           sys.executable, *train]
    run_command(cmd, dict(os.environ))
    return steps_per_sec(metric_windows(out))


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    n = a.ranks
    rows, result = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("lora", "full"):
            one = _run(1, kind, "after_backward", a, Path(tmp) / f"{kind}-1")
            after = _run(n, kind, "after_backward", a, Path(tmp) / f"{kind}-after")
            over = _run(n, kind, "overlap", a, Path(tmp) / f"{kind}-overlap")
            step1, step_after, step_over = 1000 / one, 1000 / after, 1000 / over
            rows.append((kind, one, after, over, step1, step_after, step_over))
            result[f"weak_scaling_{kind}"] = max(after, over) / one  # per-rank work is equal: steps/s ratio
            result[f"overlap_speedup_{kind}"] = step_after / step_over
            result[f"exposed_comm_ms_after_{kind}"] = step_after - step1
            result[f"exposed_comm_ms_overlap_{kind}"] = step_over - step1
            result[f"exposed_comm_fraction_overlap_{kind}"] = max(step_over - step1, 0.0) / step_over
    result["exposed_comm_fraction_overlap"] = result["exposed_comm_fraction_overlap_full"]
    print(f"scaling benchmark: {n} ranks vs 1 on loopback (ring backend), embedded tiny model, "
          f"local batch {a.local_batch}, {a.iters} steps, buckets {a.bucket_mb} MB")
    print(f"threads: meshtune launch --pin (one core per rank, OPENBLAS_NUM_THREADS=1); {describe_blas()}")
    print(f"{'':<6}{'1 rank':>12}{f'{n} after_bwd':>16}{f'{n} overlap':>14}   step ms (1 / after / overlap)"
          f"   weak eff.   overlap speedup")
    for kind, one, after, over, s1, sa, so in rows:
        print(f"{kind:<6}{one:>9.1f} st/s{after:>12.1f} st/s{over:>10.1f} st/s   {s1:6.1f} / {sa:6.1f} / {so:6.1f}"
              f"   {100 * result[f'weak_scaling_{kind}']:8.1f}%   {result[f'overlap_speedup_{kind}']:.2f}x")
    if a.json:
        print(json.dumps(result))
    return 0
