"""Watching real runs: one line per report in captured output, report.md/loss.png, TensorBoard and W&B files,
and every rank's peak memory and communication or bubble share in metrics.jsonl."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT, run_cli

RUN = ["--iters", "4", "--train.steps_per_report", "2", "--steps-per-eval", "2", "--batch-size", "4",
       "--train.val_batches", "2"]


def _records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == kind]


def _check_lines(proc: subprocess.CompletedProcess, run: Path, prefix: str = "") -> list[dict]:
    """No progress-bar frames; exactly one train line per train record; the summary line last."""
    assert "\r" not in proc.stdout and "\r" not in proc.stderr and "step/s" not in proc.stderr
    train = _records(run, "train")
    lines = [l for l in proc.stdout.splitlines() if ": train loss " in l]
    assert len(lines) == len(train) == 2
    for line, rec in zip(lines, train):
        assert line.startswith(f"{prefix}step {rec['step']}: train loss {rec['loss']:.4f}, "
                               f"lr {rec['learning_rate']:.3e}, {rec['tokens_per_sec']:.0f} tok/s, "
                               f"peak mem {rec['peak_memory_gb']:.3f} GB")
    done = [l for l in proc.stdout.splitlines() if l.startswith(f"{prefix}done: ")]
    val = _records(run, "val")
    assert len(done) == 1 and done[0].startswith(
        f"{prefix}done: 4 steps, {train[-1]['trained_tokens']} tokens in ")
    assert f"final train loss {train[-1]['loss']:.4f}, val loss {val[-1]['val_loss']:.4f}" in done[0]
    assert f"report {run / 'report.md'}, plot {run / 'loss.png'}" in done[0]
    return train


def _wandb_history(run: Path) -> list[dict]:
    """The history rows of an offline W&B run, read from its .wandb file (W&B's record log)."""
    from wandb.proto import wandb_internal_pb2 as pb

    path, = glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    rows, pos, block, pending = [], 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_one_process_run_with_tensorboard_and_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    proc = run_cli("train", *RUN, "--report-to", "tensorboard,wandb", "--project-name", "watch-test",
                   "--adapter-path", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = _check_lines(proc, run)
    val = _records(run, "val")
    assert proc.stdout.splitlines()[-1].startswith("done: ")
    assert all(r["peak_memory_gb_per_rank"] == [r["peak_memory_gb"]] for r in train)
    assert all("comm_share" not in r and "bubble_share" not in r for r in train)

    head = (run / "loss.png").read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24]) == (800, 500)
    report = (run / "report.md").read_text()
    assert f"| tokens trained | {train[-1]['trained_tokens']} |" in report
    assert f"| train loss | {train[0]['loss']:.4f} (step 2) -> {train[-1]['loss']:.4f} (step 4) |" in report
    assert f"| validation loss | {val[0]['val_loss']:.4f} (step 0) -> {val[-1]['val_loss']:.4f} (step 4) |" in report
    assert "| layout | 1 rank: dp 1, pp 1 |" in report

    # The report is made again, the same, from the finished run's files alone.
    before = report
    (run / "report.md").unlink()
    again = subprocess.run([sys.executable, "-m", "meshtune.report", str(run)], capture_output=True,
                           text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert again.returncode == 0, again.stderr
    assert (run / "report.md").read_text() == before

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    for tag, key, recs in (("train/loss", "loss", train), ("train/learning_rate", "learning_rate", train),
                           ("train/tokens_per_sec", "tokens_per_sec", train),
                           ("train/peak_memory_gb", "peak_memory_gb", train), ("val/loss", "val_loss", val)):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [r["step"] for r in recs], tag
        assert [e.value for e in events] == pytest.approx([r[key] for r in recs], rel=1e-6), tag

    history = _wandb_history(run)
    logged = {(row["_step"], k): v for row in history for k, v in row.items() if "/" in k and not k.startswith("_")}
    assert {(r["step"], "train/loss"): r["loss"] for r in train}.items() <= logged.items()
    assert {(r["step"], "val/loss"): r["val_loss"] for r in val}.items() <= logged.items()
    assert glob.glob(str(run / "wandb" / "offline-run-*" / "files"))


def test_a_missing_tracker_library_is_one_line_before_the_model_loads(tmp_path):
    fake = tmp_path / "lib"
    fake.mkdir()
    (fake / "tensorboardX.py").write_text("raise ImportError('No module named tensorboardX')\n")
    proc = subprocess.run([sys.executable, "-m", "meshtune.cli", "train", *RUN, "--report-to", "tensorboard",
                           "--adapter-path", str(tmp_path / "run")], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=f"{fake}{os.pathsep}{ROOT}"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshtune") and lines[0].endswith(
        ": output.report_to=tensorboard needs tensorboardX: pip install 'meshtune[tensorboard]', "
        "or leave out --report-to")
    assert "loading model" not in proc.stdout


def _launch(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "meshtune.cli"]
    proc = subprocess.run([*cmd, "launch", "-n", "2", "--", *cmd, "train", *RUN, *args, "--adapter-path", str(run)],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        assert f"[rank {rank}] rank {rank} finished at step 4" in proc.stdout
    return proc, run


@pytest.mark.parametrize("args,share,layout", [
    (["--parallel.transport", "sockets"], "comm_share", "2 ranks: dp 2, pp 1"),
    (["--parallel.pp", "2", "--parallel.schedule", "gpipe", "--parallel.micro_batches", "2"], "bubble_share",
     "2 ranks: dp 1, pp 2, schedule gpipe, 2 micro-batches"),
])
def test_two_ranks_report_every_rank_and_their_waits(tmp_path, args, share, layout):
    proc, run = _launch(tmp_path, *args)
    train = _check_lines(proc, run, prefix="[rank 0] ")
    finished = {}  # each rank's own last words: its peak, which no report can exceed
    for rank in range(2):
        line = next(l for l in proc.stdout.splitlines() if l.startswith(f"[rank {rank}] rank {rank} finished"))
        finished[rank] = float(line.split("peak memory ")[1].split(" GB")[0])
    for rec in train:
        per_rank = rec["peak_memory_gb_per_rank"]
        assert len(per_rank) == 2 and rec["peak_memory_gb"] == max(per_rank) and min(per_rank) > 0
        assert all(per_rank[r] <= finished[r] + 1e-4 for r in range(2))
        assert 0.0 < rec[share] <= 1.0  # the sockets ring's all-reduce, the pipeline's bubble: never free
        assert f", {share.removesuffix('_share')} {100 * rec[share]:.1f}%" in proc.stdout
    assert not any(l.startswith("[rank 1] ") and ": train loss" in l for l in proc.stdout.splitlines())
    report = (run / "report.md").read_text()
    assert f"| layout | {layout} |" in report
    assert f"| {share.replace('_', ' ')}, measured (mean of the reports) |" in report
