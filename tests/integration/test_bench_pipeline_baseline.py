"""`meshtune bench pipeline`: every schedule is compared with naive at M=1, the whole batch at once."""

from __future__ import annotations

import json

import pytest

from support import run_cli


def test_bench_pipeline_ratios_are_over_naive_at_one_micro_batch():
    proc = run_cli("bench", "pipeline", "--micro-batches", "1,4", "--iters", "3", "--batch-size", "4", "--repeats",
                   "2", "--json", timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    result = json.loads(lines[-1])
    rows = [line.split() for line in lines if line[:3].strip().isdigit()]
    # One baseline row (naive, M=1), then GPipe and 1F1B at M=4; naive runs at M=1 only.
    assert [(r[0], r[1]) for r in rows] == [("1", "naive"), ("4", "gpipe"), ("4", "1f1b")], proc.stdout
    assert rows[0][4] == "1.00x" and "vs M=1" in proc.stdout
    # Each row is its median run of 2 (the lower), the runs' range beside it.
    for m, name in (("1", "naive"), ("4", "gpipe"), ("4", "1f1b")):
        runs = result[f"{name}_steps_per_s_m{m}_runs"]
        assert len(runs) == 2 and result[f"{name}_steps_per_s_m{m}"] == runs[0] <= runs[1]
        assert [r for r in rows if (r[0], r[1]) == (m, name)][0][3] == f"{runs[0]:.2f}-{runs[1]:.2f}"
    assert "each row: the median of 2 runs (by steps/s), in interleaved rounds" in proc.stdout
    base = result["naive_steps_per_s_m1"]
    for name in ("gpipe", "1f1b"):
        assert result[f"{name}_over_naive_m4"] == pytest.approx(result[f"{name}_steps_per_s_m4"] / base)
        assert f"{result[f'{name}_over_naive_m4']:.2f}x" == [r for r in rows if r[1] == name][0][4]
    best = max(result["gpipe_steps_per_s_m4"], result["1f1b_steps_per_s_m4"])
    assert result["best_over_m1"] == pytest.approx(best / base)
    assert result["best_schedule"] in ("gpipe M=4", "1f1b M=4")
    assert f"best: {result['best_schedule']} at {result['best_over_m1']:.2f}x naive M=1" in proc.stdout
    assert "naive_steps_per_s_m4" not in result and len(result["peak_gb_naive_m1"]) == 2
    # The measured bubble (the mean over stages) of every row, beside the schedule's analytic idle share.
    assert all(0 < result[f"bubble_{name}_m{m}"] <= 1 for m, name in (("1", "naive"), ("4", "gpipe"), ("4", "1f1b")))
    assert rows[0][6:8] == [f"{result['bubble_naive_m1']:.0%}", "50%"] and rows[1][7] == "20%"


def test_bench_pipeline_names_bad_micro_batch_counts():
    proc = run_cli("bench", "pipeline", "--micro-batches", "1,x", timeout=60)
    assert proc.returncode == 2 and "--micro-batches '1,x'" in proc.stderr, proc.stderr
