"""meshtune plan against meshtune's own runs, through `meshtune bench plan`: its per-rank estimate vs each rank's peak.

The bench runs the tiny model on the arithmetic data (inputs padded to 32 tokens) for 1
rank, DP 2 and PP 2 (1F1B, 2 micro-batches), and the plan for each; every rank's
`peak_memory_gb_per_rank` in metrics.jsonl (mx.get_peak_memory) must be within 15% of the
plan's figure for that rank's stage, the assertion message stating the error. Also the
command's own contract: --json's last line, one-line errors with exit code 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import ARITH_DATA, TINY_MODEL, run_cli

RUN = ["--model", str(TINY_MODEL), "--data", str(ARITH_DATA), "--num-layers", "-1", "--batch-size", "8"]
TOLERANCE = 0.15


def _bench(*args: str) -> dict:
    out = run_cli("bench", "plan", *args, "--json")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(out.stdout)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _report(rows: list[dict]) -> str:
    return ", ".join(f"{r['layout']} rank {r['rank']}: estimate {r['estimate'] / 1e6:.2f} MB vs measured "
                     f"{r['measured'] / 1e6:.2f} MB ({r['error']:+.1%})" for r in rows)


def test_estimate_within_15_percent_of_each_ranks_peak() -> None:
    result = _bench("--layouts", "1,dp2,pp2", "--jobs", "3")
    rows = result["rows"]
    assert [(r["layout"], r["rank"], r["stage"]) for r in rows] == [
        ("1 process", 0, 0), ("DP 2", 0, 0), ("DP 2", 1, 0), ("PP 2", 0, 0), ("PP 2", 1, 1)], rows
    for r in rows:  # the error is the estimate's against the measured peak; the parts add up to the estimate
        assert r["measured"] > 1e6 and r["error"] == (r["estimate"] - r["measured"]) / r["measured"], r
        part = r["parts"]
        assert 0 <= part["overlap"] <= part["grads"] <= part["update"], r
        static = part["weights"] + part["adapters"] + part["optimizer"] + part["comm_buffers"]
        backward = max(part["grads"], part["activations"]) + part["overlap"]
        assert static + max(backward, part["update"]) == pytest.approx(r["estimate"]), r
    assert all(abs(r["error"]) <= TOLERANCE for r in rows), _report(rows)


def test_quantized_model_estimate_within_15_percent() -> None:
    """The tiny model quantized to 4 bits (bf16 scales): quantized words, scales and biases, bf16 activations."""
    result = _bench("--quantize", "--layouts", "1")
    rows = result["rows"]
    assert "4 bits" in result["what"] and result["rows"][0]["parts"]["weights"] < 1e6, result
    assert len(rows) == 1 and abs(rows[0]["error"]) <= TOLERANCE, f"4-bit: {_report(rows)}"


def test_json_table_and_one_line_errors(tmp_path: Path) -> None:
    out = run_cli("plan", *RUN, "--ranks", "2", "--seq-len", "32")
    assert out.returncode == 0, out.stderr
    assert any(line.startswith("recommended: DP 2") for line in out.stdout.splitlines()), out.stdout
    assert max(len(line) for line in out.stdout.splitlines()) <= 120
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": f"h{i}", "ips": [f"10.0.0.{i}"]} for i in range(4)]))
    plan = json.loads(run_cli("plan", *RUN, "--hostfile", str(hosts), "--json").stdout.strip().splitlines()[-1])
    assert plan["ranks"] == 4 and plan["layouts"][-1]["layout"] == "PP 4"
    for cmd, words in ((("plan", *RUN, "--link", "fast"), "--link 'fast'"),
                       (("plan", *RUN, "--model", "someone/not-downloaded"), "plan reads a local folder"),
                       (("bench", "plan", "--layouts", "1,dp1"), "--layouts 1,dp1"),
                       (("plan", *RUN, "--rank", "2"), "unknown option --rank; did you mean --adapter.rank")):
        bad = run_cli(*cmd)
        assert bad.returncode == 2 and words in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
