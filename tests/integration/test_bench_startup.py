"""`meshtune bench startup`: every kind has a cold and a warm run whose phases add up, the table
and the JSON say the same, a CPU picks the tiny preset, and a bad --runs-per-cache is one line (exit 2)."""

from __future__ import annotations

import re

import pytest

from support import run_bench_json, run_cli

ROW = re.compile(r"^  (full|lora|dora)\s+(cold|warm)\s+" + r"\s+".join([r"(-?\d+\.\d+)"] * 5) + r"$")
COLUMNS = ("start", "load", "first_step", "total", "steady_step")


@pytest.fixture(scope="module")
def bench():
    return run_bench_json("startup", "--preset", "tiny", timeout=300)


def test_every_kind_has_a_cold_and_a_warm_run(bench):
    _, result = bench
    runs = [(r["kind"], r["cache"]) for r in result["rows"]]
    assert runs == [("full", "cold"), ("full", "warm"), ("lora", "cold"), ("lora", "warm")]
    assert set(result["cold_over_warm"]) == {"full", "lora"}
    assert result["preset"] == "tiny" and result["dtype"] == "float32" and result["iters"] == 2


def test_phases_are_positive_ordered_and_add_up(bench):
    _, result = bench
    for r in result["rows"]:
        s = r["stamps"]
        assert all(r[c] > 0 for c in COLUMNS), r
        assert 0 < s["first_line"] <= s["loaded"] <= s["step1"] <= s["step2"], s
        assert r["start"] <= r["total"] and r["first_step"] <= r["total"], r
        assert r["start"] + r["load"] + r["first_step"] == pytest.approx(r["total"], abs=1e-9), r
        assert r["steady_step"] == pytest.approx(s["step2"] - s["step1"]), r
    for kind, ratio in result["cold_over_warm"].items():
        cold, warm = (r["total"] for r in result["rows"] if r["kind"] == kind)
        assert ratio == pytest.approx(cold / warm), kind


def test_table_matches_json(bench):
    table, result = bench
    rows = [m.groups() for m in map(ROW.match, table) if m]
    assert len(rows) == len(result["rows"]), table
    for printed, r in zip(rows, result["rows"]):
        assert printed[:2] == (r["kind"], r["cache"])
        for cell, column in zip(printed[2:], COLUMNS):
            assert float(cell) == pytest.approx(r[column], abs=6e-4), (column, printed, r)
    ratios = next(line for line in table if "cold total / warm total:" in line)
    for kind, ratio in result["cold_over_warm"].items():
        assert f"{kind} {ratio:.2f}x" in ratios
    assert any(line.startswith("preset: tiny ") for line in table)
    assert any(f"MLX {result['mlx']}" in line and result["device"] in line for line in table)


def test_the_preset_is_the_largest_that_fits_and_1_7b_needs_a_gpu():
    from meshtune.bench.fit import Machine
    from meshtune.bench.startup import choose_preset

    chosen, line = choose_preset(None, None, None, 4, Machine("CPU", "test", 10 ** 12))
    assert chosen == "small" and "pass --preset 1.7b" in line and "and a GPU" in line
    chosen, line = choose_preset(None, None, None, 4, Machine("CPU", "test", 10 ** 6))
    assert chosen == "tiny"
    chosen, _ = choose_preset(None, None, None, 2, Machine("GPU", "test", 140 * 10 ** 9))
    assert chosen == "1.7b"
    chosen, _ = choose_preset(None, None, None, 2, Machine("GPU", "test", 4 * 10 ** 9))
    assert chosen == "small"


def test_bad_runs_per_cache_is_one_line():
    proc = run_cli("bench", "startup", "--runs-per-cache", "0")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--runs-per-cache 0" in lines[0], lines
