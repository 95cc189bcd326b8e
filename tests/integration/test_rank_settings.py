"""Ranks given different settings (each host's own run.yaml, a flag built from MLX_RANK) stop at start
with one line naming the settings, where they would hang at the first step or train apart."""

from __future__ import annotations

import subprocess
import sys

from meshtune.bench.faultkit import CLI, env


def test_ranks_with_different_settings_name_them_before_training(tmp_path):
    run = tmp_path / "run"
    rank_train = (f"exec {sys.executable} -m meshtune.cli train --batch-size 4 --val-batches 0 "
                  f"--adapter-path {run} --iters $((6 + 4 * MLX_RANK)) --learning-rate 1e-$((3 + MLX_RANK))")
    proc = subprocess.run([*CLI, "launch", "-n", "2", "--", "bash", "-c", rank_train], env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stdout.splitlines() if "meshtune: error:" in line]
    assert sorted(line.split("]")[0] for line in errors) == ["[rank 0", "[rank 1"], proc.stdout
    assert all("different settings for optimizer.learning_rate, train.iters; give every rank the same" in line
               for line in errors), errors
    assert "stopped answering" not in proc.stderr and not (run / "checkpoints").exists()


def test_ranks_with_the_same_settings_train(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([*CLI, "launch", "-n", "2", "--", "meshtune", "train", "--batch-size", "4", "--iters", "2",
                           "--val-batches", "0", "--adapter-path", str(run)], env=env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (run / "adapters.safetensors").exists()


def test_a_run_the_writer_refuses_stops_every_rank_with_one_line_each(tmp_path):
    """The writer alone checks the output folder; the others stop with it (no traceback, no lost link)."""
    run = tmp_path / "run"
    args = ["train", "--batch-size", "4", "--iters", "2", "--val-batches", "0", "--adapter-path", str(run)]
    first = subprocess.run([*CLI, *args], env=env(), capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    proc = subprocess.run([*CLI, "launch", "-n", "2", "--", "meshtune", *args], env=env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stdout.splitlines() if "error:" in line]
    assert any(line.startswith("[rank 0]") and "already holds a run" in line for line in errors), proc.stdout
    assert any(line.startswith("[rank 1]") and "stopping with rank 0, which refused the run" in line
               for line in errors), proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
