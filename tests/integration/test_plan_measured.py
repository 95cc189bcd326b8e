"""meshtune plan against meshtune's own runs: its per-rank estimate vs the peak memory each rank reports.

The tiny model on the arithmetic data (inputs padded to 32 tokens), for 1 rank, DP 2 and
PP 2 (1F1B, 2 micro-batches). Each rank's `peak_memory_gb_per_rank` in metrics.jsonl
(mx.get_peak_memory) must be within 15% of the plan's figure for that rank's stage; the
assertion message states the error. Also the command's own contract: --json's last line,
one-line errors with exit code 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import ARITH_DATA, ROOT, TINY_MODEL, run_cli

RUN = ["--model", str(TINY_MODEL), "--data", str(ARITH_DATA), "--num-layers", "-1", "--batch-size", "8"]
TOLERANCE = 0.15


def _plan(ranks: int, *extra: str) -> dict:
    out = run_cli("plan", *RUN, *extra, "--ranks", str(ranks), "--memory-gb", "1", "--seq-len", "32", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure(tmp: Path, ranks: int, *extra: str) -> list[float]:
    """Each rank's peak memory in bytes, from the last train record of a 4-step run."""
    train = [sys.executable, "-m", "meshtune.cli", "train", *RUN, *extra, "--iters", "4", "--val-batches", "0",
             "--steps-per-report", "2", "--adapter-path", str(tmp)]
    cmd = train if ranks == 1 else [sys.executable, "-m", "meshtune.cli", "launch", "-n", str(ranks), "--", *train]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["type"] == "train"][-1]
    per_rank = last.get("peak_memory_gb_per_rank") or [last["peak_memory_gb"]] * ranks
    assert len(per_rank) == ranks, last
    return [gb * 1e9 for gb in per_rank]


@pytest.mark.parametrize("layout,ranks,extra", [("1 process", 1, ()), ("DP 2", 2, ()),
                                                ("PP 2", 2, ("--parallel.pp", "2"))])
def test_estimate_within_15_percent_of_each_ranks_peak(tmp_path: Path, layout: str, ranks: int,
                                                       extra: tuple[str, ...]) -> None:
    row = next(r for r in _plan(ranks, *extra)["layouts"] if r["layout"] == layout)
    measured = _measure(tmp_path / "run", ranks, *extra)
    # Rank r of a pipeline with dp 1 is stage r; data-parallel ranks all match the one stage.
    estimates = [row["stages"][r % len(row["stages"])]["total"] for r in range(ranks)]
    errors = [(e - m) / m for e, m in zip(estimates, measured)]
    report = ", ".join(f"rank {r}: estimate {e / 1e6:.2f} MB vs measured {m / 1e6:.2f} MB ({err:+.1%})"
                       for r, (e, m, err) in enumerate(zip(estimates, measured, errors)))
    assert all(abs(err) <= TOLERANCE for err in errors), f"{layout}: {report}"
    print(f"{layout}: {report}")


def test_quantized_model_estimate_within_15_percent(tmp_path: Path) -> None:
    """The tiny model quantized to 4 bits (bf16 scales): quantized words, scales and biases, bf16 activations."""
    from mlx_lm import convert

    model = tmp_path / "q4"
    convert(str(TINY_MODEL), mlx_path=str(model), quantize=True, q_group_size=64, q_bits=4, dtype="bfloat16")
    swap = ["--model", str(model)]
    estimate = _plan(1, *swap)["layouts"][0]["total"]
    measured = _measure(tmp_path / "run", 1, *swap)[0]
    error = (estimate - measured) / measured
    message = f"4-bit: estimate {estimate / 1e6:.2f} MB vs measured {measured / 1e6:.2f} MB ({error:+.1%})"
    assert abs(error) <= TOLERANCE, message
    print(message)


def test_json_table_and_one_line_errors(tmp_path: Path) -> None:
    out = run_cli("plan", *RUN, "--ranks", "2", "--seq-len", "32")
    assert out.returncode == 0, out.stderr
    assert any(line.startswith("recommended: DP 2") for line in out.stdout.splitlines()), out.stdout
    assert max(len(line) for line in out.stdout.splitlines()) <= 120
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": f"h{i}", "ips": [f"10.0.0.{i}"]} for i in range(4)]))
    plan = json.loads(run_cli("plan", *RUN, "--hostfile", str(hosts), "--json").stdout.strip().splitlines()[-1])
    assert plan["ranks"] == 4 and plan["layouts"][-1]["layout"] == "PP 4"
    for args, words in ((("--link", "fast"), "--link 'fast'"),
                        (("--model", "someone/not-downloaded"), "plan reads a local folder")):
        bad = run_cli("plan", *RUN, *args)
        assert bad.returncode == 2 and words in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
