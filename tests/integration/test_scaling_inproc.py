"""`meshtune bench scaling --in-process` (the GPU form) run on the ring backend with the tiny preset:
1 rank and 2 ranks timed in one invocation, interleaved in rounds, each ratio with its spread."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from support import ROOT, run_cli

ROUNDS = 3
BENCH = ["-m", "meshtune.cli", "bench", "scaling", "--in-process", "--preset", "tiny", "--steps", "1",
         "--rounds", str(ROUNDS), "--warmup", "1", "--backend", "ring", "--json"]
KINDS = ("lora", "full")
RATIOS = ("weak_scaling", "weak_scaling_after", "weak_scaling_overlap", "overlap_speedup")


@pytest.fixture(scope="module")
def two_ranks() -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "meshtune.cli", "launch", "-n", "2", "--", sys.executable, *BENCH],
                          env=env, capture_output=True, text=True, timeout=300)


def _result(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1].split("] ", 1)[1])


def test_both_ranks_finish_and_only_rank_0_prints(two_ranks):
    assert two_ranks.returncode == 0, two_ranks.stdout[-2000:] + two_ranks.stderr[-2000:]
    lines = [l for l in two_ranks.stdout.splitlines() if l.startswith("[rank ")]
    assert lines and all(l.startswith("[rank 0] ") for l in lines), lines
    assert "[rank 0] 1 rank = each rank's own step without gradient sync" in two_ranks.stdout


def test_one_rank_and_two_ranks_come_from_the_same_rounds(two_ranks):
    out = _result(two_ranks)
    assert out["ranks"] == 2 and out["rounds"] == ROUNDS and out["one_rank"] == "mean over ranks"
    for kind in KINDS:
        per = out[f"step_ms_rounds_{kind}"]
        assert {m: len(v) for m, v in per.items()} == {"compute": ROUNDS, "after_backward": ROUNDS, "overlap": ROUNDS}
        # Each ratio is per round, from that round's own 1-rank and 2-rank steps.
        weak = sorted(c / min(a, o) for c, a, o in zip(per["compute"], per["after_backward"], per["overlap"]))
        speed = sorted(a / o for a, o in zip(per["after_backward"], per["overlap"]))
        assert out[f"weak_scaling_{kind}"] == pytest.approx(weak[1])
        assert out[f"weak_scaling_{kind}_spread"] == pytest.approx([weak[0], weak[-1]])
        assert out[f"overlap_speedup_{kind}"] == pytest.approx(speed[1])
        assert out[f"overlap_speedup_{kind}_spread"] == pytest.approx([speed[0], speed[-1]])
        # tokens/s from the median steps: 2 x 32 tokens per rank per step.
        step = out[f"step_ms_{kind}"]
        assert out[f"tok_s_1_{kind}"] == pytest.approx(64 / (step["compute"] / 1e3))
        assert out[f"tok_s_2_after_{kind}"] == pytest.approx(2 * 64 / (step["after_backward"] / 1e3))
        assert out[f"overlap_sum_mismatch_{kind}"] < 1e-5


def test_every_spread_brackets_its_median(two_ranks):
    out = _result(two_ranks)
    for kind in KINDS:
        for ratio in RATIOS:
            low, high = out[f"{ratio}_{kind}_spread"]
            assert 0 < low <= out[f"{ratio}_{kind}"] <= high, (ratio, kind)


def test_the_table_prints_the_json_figures(two_ranks):
    out = _result(two_ranks)
    for kind in KINDS:
        row = re.search(rf"^\[rank 0\] {kind} +(.*)$", two_ranks.stdout, re.M)
        assert row, kind
        f = re.findall(r"(?<![\d.])-?\d+(?:\.\d+)?(?:e[-+]\d+)?", row.group(1))  # 60.8-117.1: two
        step = out[f"step_ms_{kind}"]
        weak, (wlo, whi) = out[f"weak_scaling_{kind}"], out[f"weak_scaling_{kind}_spread"]
        speed, (slo, shi) = out[f"overlap_speedup_{kind}"], out[f"overlap_speedup_{kind}_spread"]
        expected = [f"{out[f'tok_s_1_{kind}']:.0f}", f"{out[f'tok_s_2_after_{kind}']:.0f}",
                    f"{out[f'tok_s_2_overlap_{kind}']:.0f}", f"{step['compute']:.1f}",
                    f"{step['after_backward']:.1f}", f"{step['overlap']:.1f}",
                    f"{out[f'exposed_comm_ms_after_{kind}']:.1f}", f"{out[f'exposed_comm_ms_overlap_{kind}']:.1f}",
                    f"{100 * weak:.1f}", f"{100 * wlo:.1f}", f"{100 * whi:.1f}",
                    f"{speed:.2f}", f"{slo:.2f}", f"{shi:.2f}", f"{out[f'overlap_sum_mismatch_{kind}']:.1e}"]
        assert f == expected, (kind, row.group(1))


def test_the_separate_baseline_flag_is_gone_and_bad_rounds_is_one_line():
    gone = run_cli("bench", "scaling", "--in-process", "--one-rank-json", "x.txt", timeout=120)
    assert gone.returncode == 2 and "--one-rank-json" in gone.stderr
    bad = run_cli("bench", "scaling", "--in-process", "--preset", "tiny", "--rounds", "0", timeout=120)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert bad.stderr.strip().splitlines() == [bad.stderr.strip()] and "--rounds 0" in bad.stderr
