"""`meshtune bench scaling --in-process` (the GPU form) run on the ring backend with the tiny preset."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import ROOT

BENCH = ["-m", "meshtune.cli", "bench", "scaling", "--in-process", "--preset", "tiny", "--steps", "2",
         "--rounds", "1", "--json"]


def test_one_process_then_two_ranks_with_its_baseline(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    one = subprocess.run([sys.executable, *BENCH], env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    first = json.loads(one.stdout.strip().splitlines()[-1])
    assert first["ranks"] == 1 and first["step_ms_lora"]["compute"] > 0
    (tmp_path / "one.txt").write_text(one.stdout)
    two = subprocess.run([sys.executable, "-m", "meshtune.cli", "launch", "-n", "2", "--", sys.executable, *BENCH,
                          "--backend", "ring", "--one-rank-json", str(tmp_path / "one.txt")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
    assert "[rank 0] 1 rank = a separate 1-process run" in two.stdout and "[rank 1]" not in two.stdout.replace(
        "[rank 1] rank", "")  # only rank 0 prints the table
    out = json.loads(two.stdout.strip().splitlines()[-1].split("] ", 1)[1])
    assert out["ranks"] == 2
    # The 1-rank figure is the baseline's step, and the sums of both modes agree.
    assert out["tok_s_1_lora"] == pytest.approx(2 * 32 / (first["step_ms_lora"]["compute"] / 1e3))
    assert out["overlap_sum_mismatch_lora"] < 1e-5 and out["overlap_sum_mismatch_full"] < 1e-5


def test_baseline_without_a_result_is_one_line(tmp_path):
    from meshtune.bench.scaling_inproc import _one_rank_ms

    (tmp_path / "empty.txt").write_text("no json here\n")
    with pytest.raises(ValueError, match="--one-rank-json .*no 1-rank result"):
        _one_rank_ms(str(tmp_path / "empty.txt"))
