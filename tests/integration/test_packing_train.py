"""`meshtune train --data.pack true` on the embedded model and arithmetic data: one rank, two data-parallel
ranks resuming the one-rank run's checkpoint, and a two-stage pipeline report the same losses; without
--max-seq-length the rows are the length picked for the data, said, recorded and resumed alike, and
`meshtune bench packing` times those rows.

Every multi-rank run goes through `meshtune launch -n 2` on the ring backend, and each rank's finish
line is checked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import ARITH_DATA, ROOT

STEPS = ["--iters", "4", "--batch-size", "4", "--max-seq-length", "128", "--data.pack", "true",
         "--train.steps_per_report", "2", "--steps-per-eval", "4", "--save-every", "2", "--train.val_batches", "2",
         "--optimizer", "sgd", "--learning-rate", "0.05"]


def _run(n: int, out: Path, *args: str, drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`meshtune train` with STEPS, less the flag and value `drop` names, and `args`."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "meshtune.cli"]
    steps = STEPS
    if drop:
        at = STEPS.index(drop[0])
        steps = STEPS[:at] + STEPS[at + len(drop):]
    train = ["train", *steps, *args, "--adapter-path", str(out)]
    full = [*cmd, "launch", "-n", str(n), "--", *cmd, *train] if n > 1 else [*cmd, *train]
    proc = subprocess.run(full, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(n if n > 1 else 0):
        assert f"[rank {rank}] rank {rank} finished at step 4" in proc.stdout, proc.stdout[-3000:]
    return proc


def _losses(run: Path) -> dict[tuple[str, int], float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {(r["type"], r["step"]): r.get("loss", r.get("val_loss")) for r in rows if r["type"] in ("train", "val")}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pack") / "one"
    _run(1, out)
    return out


def test_one_rank_trains_packed(one_rank):
    losses = _losses(one_rank)
    assert {("train", 2), ("train", 4), ("val", 0), ("val", 4)} <= set(losses)
    assert losses[("val", 4)] < losses[("val", 0)]  # it learned
    assert (one_rank / "adapters.safetensors").exists()


def test_two_ranks_resume_the_one_rank_checkpoint(one_rank, tmp_path):
    # Data parallel, and a resumed data cursor, on packed rows: the step-2 checkpoint of one rank,
    # continued on two, reports the one-rank run's losses for steps 3 and 4.
    run = tmp_path / "two"
    shutil.copytree(one_rank, run)
    shutil.rmtree(run / "checkpoints" / "0000004")
    proc = _run(2, run, "--resume")
    assert "resumed from step 2" in proc.stdout
    ours, ref = _losses(run), _losses(one_rank)
    for key in (("train", 4), ("val", 4)):
        assert ours[key] == pytest.approx(ref[key], rel=1e-4), key


def test_pipeline_two_stages_matches(one_rank, tmp_path):
    _run(2, tmp_path / "pp", "--parallel.pp", "2")
    ours, ref = _losses(tmp_path / "pp"), _losses(one_rank)
    for key in (("train", 2), ("train", 4), ("val", 4)):
        assert ours[key] == pytest.approx(ref[key], rel=1e-4), key


def test_rows_default_to_what_the_data_needs_and_a_resume_packs_alike(tmp_path):
    # No --max-seq-length: rows of the length picked for the data and the model, said at start and recorded
    # in the run's config, so the resumed run packs the same rows and reports the same losses.
    out = tmp_path / "picked"
    proc = _run(1, out, "--data", str(ARITH_DATA), drop=("--max-seq-length", "128"))
    said = [line for line in proc.stdout.splitlines() if line.startswith("data.pack:")]
    assert said == ["data.pack: rows of 96 tokens (the cheapest per target token for examples of up to 23 tokens, "
                    "on a model whose attention costs as much as its weights at 137-token rows; --max-seq-length "
                    "or --data.pack_length sets it)"], proc.stdout[-3000:]
    assert "data.pack fills rows" not in proc.stdout  # rows far longer than the examples: not these
    data = json.loads((out / "adapter_config.json").read_text())["meshtune"]["data"]
    assert (data["pack_length"], data["max_seq_length"]) == (96, 2048)
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "0000004")
    proc = _run(1, resumed, "--resume", drop=("--max-seq-length", "128"))
    assert "data.pack: rows of 96 tokens (data.pack_length)" in proc.stdout
    ours, ref = _losses(resumed), _losses(out)
    for key in (("train", 4), ("val", 4)):
        assert ours[key] == pytest.approx(ref[key], rel=1e-4), key


def test_bench_packing_prints_each_setting_and_json(cli):
    proc = cli("bench", "packing", "--steps", "2", "--row-lengths", "64", "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # With no --max-seq-length the packed rows are the ones meshtune train picks (the test above).
    assert "data.pack: rows of 96 tokens (the cheapest per target token" in proc.stdout
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| data.pack | row tokens | target tokens/s | padding share") and len(table) == 4
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    plain, packed, other = result["runs"]
    assert (plain["pack"], packed["pack"], other["pack"]) == (False, True, True)
    assert (result["row_length"], packed["row_length"], other["row_length"]) == (96, 96, 64)
    # Packed rows carry less padding and more examples a step; the speed-up is the table's own ratio.
    assert packed["padding_share"] < plain["padding_share"] and packed["examples_per_step"] > 4
    assert result["speedup"] == pytest.approx(packed["target_tokens_per_sec"] / plain["target_tokens_per_sec"])
    assert f"rows of 96 (target tokens/s): {result['speedup']:.2f}x" in proc.stdout
