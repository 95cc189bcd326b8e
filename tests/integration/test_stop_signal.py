"""SIGTERM during training: the run saves a checkpoint at the next agreed step, exits, and resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import ROOT
from test_launch_ssh import _hostfile
from meshtune.training.checkpoint import verify_checkpoint

ARGS = ["--batch-size", "8", "--num-layers", "-1", "--learning-rate", "1e-3", "--train.steps_per_report", "1",
        "--train.val_batches", "0", "--save-every", "100000"]


def _train_records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == "train"]


def _signal_once_training(cmd, env, run: Path, sig: int, cwd=None) -> tuple[subprocess.Popen, int, str]:
    """Start `cmd`, send `sig` once three reports are written: (the process, the last reported step, its output)."""
    return _signal_training(cmd, env, run, [sig], cwd=cwd)


def test_sigterm_saves_and_stops_then_resume_continues(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "meshtune.cli", "train", "--iters", "100000", *ARGS, "--adapter-path", str(run)]
    proc, seen, out = _signal_once_training(cmd, env, run, signal.SIGTERM)
    assert proc.returncode == 3, out[-2000:]  # meshtune/cli/commands.py: 3 = stopped on request, resumable
    stopped = [line for line in out.splitlines() if "stopped at step" in line]
    assert len(stopped) == 1, out[-2000:]
    step = int(stopped[0].split("stopped at step ")[1].split()[0])
    assert seen <= step <= seen + 10, (seen, step)  # at the step after the request, not at --iters
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert saved == [f"{step:07d}"], saved  # --save-every 100000: the stop's checkpoint is the only one
    assert verify_checkpoint(run / "checkpoints" / saved[0]) is None  # complete, every file matching its sha256
    resumed = subprocess.run([*cmd[:cmd.index("--iters") + 1], str(step + 2), *ARGS, "--adapter-path", str(run),
                              "--resume"], env=env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resumed from step {step}" in resumed.stdout
    assert _train_records(run)[-1]["step"] == step + 2


# As a real ssh: the local client and the remote rank are two processes (the rank in a session of its
# own), and a signal to the client ends the client, not the rank.
SEPARATE_SSH = """#!/bin/sh
host="$1"; shift
env -i PATH="$PATH" HOME="$HOME" setsid /bin/sh -c "$*" &
wait $!
"""


def _separate_ssh(tmp_path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(SEPARATE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("ranks", ["local", "ssh"])
def test_ctrl_c_on_the_launcher_saves_on_every_rank_and_stops_them(tmp_path, ranks):
    """Ctrl-C (SIGINT) or a scheduler's SIGTERM to `meshtune launch` reaches every rank once, local or
    over ssh (a stand-in ssh: the remote rank gets it, its ssh client stays open): they save
    one checkpoint together, each exits 3, the launcher exits 3 and prints the resume line; no rank
    outlives it."""
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    where = ["-n", "2"]
    if ranks == "ssh":
        env = _separate_ssh(tmp_path) | {"PYTHONPATH": str(ROOT)}
        where = ["--hostfile", str(_hostfile(tmp_path, 2))]
    cmd = [sys.executable, "-m", "meshtune.cli", "launch", *where, "--", "meshtune", "train", "--iters", "100000",
           *ARGS, "--adapter-path", str(run)]
    proc, seen, out = _signal_once_training(cmd, env, run, signal.SIGINT, cwd=tmp_path)
    assert proc.returncode == 3, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "meshtune launch: SIGINT: every rank saves a checkpoint and stops" in out
    stopped = [line for line in out.splitlines() if "stopped at step" in line]
    assert len(stopped) == 1 and stopped[0].startswith("[rank 0]"), out[-3000:]  # the writer says it once
    step = int(stopped[0].split("stopped at step ")[1].split()[0])
    # Soon after the request, not at --iters: the launcher passes it on within its 0.2 s poll, and the
    # ranks agree on it at their next agreement (every 8 steps), tiny steps running meanwhile.
    assert seen <= step <= seen + 50, (seen, step)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"{step:07d}"]
    assert verify_checkpoint(run / "checkpoints" / f"{step:07d}") is None
    assert f"to continue from step {step}: meshtune launch {' '.join(where)} -- meshtune train" in out
    # The report's line says the same, and so does the report of the run read afterwards (the start record).
    assert f"; resume with meshtune launch {' '.join(where)} -- meshtune train" in out, out[-3000:]
    report = subprocess.run([sys.executable, "-m", "meshtune.report", str(run)], env=env,
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0 and f"; resume with meshtune launch {' '.join(where)} -- meshtune train" \
        in report.stdout, report.stdout + report.stderr
    assert "exited with code" not in out  # an agreed stop, not a failed rank
    assert subprocess.run(["pgrep", "-f", str(run)], capture_output=True).returncode == 1  # no rank left


def _signal_training(cmd, env, run: Path, signals: list[int], cwd=None) -> tuple[subprocess.Popen, int, str]:
    """`_signal_once_training` with several signals sent one after another (Ctrl-C twice, a scheduler's
    SIGTERM after a user's SIGINT)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
    deadline = time.monotonic() + 120
    while len(_train_records(run)) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    seen = _train_records(run)[-1]["step"]
    for sig in signals:
        proc.send_signal(sig)
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=120)
    return proc, seen, out


@pytest.mark.parametrize("launcher", [False, True], ids=["one-process", "launch-n2"])
def test_repeated_signals_end_with_one_save_the_report_and_exit_3(tmp_path, launcher):
    """SIGTERM, SIGINT, SIGTERM, SIGINT in quick succession: still one checkpoint, one stop line, the report,
    the resume line and exit 3, with no traceback (a later signal never interrupts the save or the report)."""
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    train = ["meshtune", "train", "--iters", "100000", *ARGS, "--adapter-path", str(run)]
    cmd = ([sys.executable, "-m", "meshtune.cli", "launch", "-n", "2", "--", *train] if launcher
           else [sys.executable, "-m", "meshtune.cli", *train[1:]])
    proc, seen, out = _signal_training(cmd, env, run, [signal.SIGTERM, signal.SIGINT, signal.SIGTERM, signal.SIGINT])
    assert proc.returncode == 3, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    stopped = [line for line in out.splitlines() if "stopped at step" in line]
    assert len(stopped) == 1, out[-3000:]
    step = int(stopped[0].split("stopped at step ")[1].split()[0])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"{step:07d}"]
    assert verify_checkpoint(run / "checkpoints" / f"{step:07d}") is None
    assert f"to continue from step {step}: " in out and (run / "report.md").exists(), out[-3000:]


def test_ctrl_c_during_set_up_is_one_line_and_writes_no_checkpoint(tmp_path):
    """SIGINT while the model loads: one `meshtune:` line naming the signal and set-up, exit 130, no traceback."""
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "meshtune.cli", "train", "--iters", "50", *ARGS,
                             "--adapter-path", str(run)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("loading model"):
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-2000:] + err[-2000:]
    assert "Traceback" not in out + err
    said = [line for line in err.splitlines() if line.startswith("meshtune:")]
    assert len(said) == 1 and "stopped on request (SIGINT) during set-up, before step 1" in said[0], err
    assert not run.exists()  # nothing written: the same command starts the run afresh
    again = subprocess.run([sys.executable, "-m", "meshtune.cli", "train", "--iters", "2", *ARGS,
                            "--adapter-path", str(run)], env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
