"""One run per folder, end to end: a second run on a held folder, a lock left by a killed run, two
launchers started together, --output.overwrite dying before its first save, a folder of an earlier run
that saved nothing, a dangling --adapter-path link."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from meshtune.bench.faultkit import CLI, FaultRun, env, train_args
from support import run_cli

LONG = 400  # steps: long enough that a second run starts while the first trains


def _records(run) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def _wait_training(run, proc, reports: int = 2) -> None:
    deadline = time.monotonic() + 120
    while sum(r["type"] == "train" for r in _records(run)) < reports:
        assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.1)


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-process", "launch-n2"])
def test_a_second_run_on_a_held_folder_stops_at_once_naming_the_holder(tmp_path, ranks):
    run = tmp_path / "run"
    args = train_args(run, iters=LONG, save_every=1)
    start = (lambda: FaultRun.launch(ranks, args)) if ranks > 1 else (lambda: FaultRun([*CLI, *args]))
    first = start()
    try:
        _wait_training(run, first.proc)
        tic = time.monotonic()
        second = subprocess.run([*CLI, "launch", "-n", str(ranks), "--", *CLI, *args] if ranks > 1
                                else [*CLI, *args], env=env(), capture_output=True, text=True, timeout=120)
        took = time.monotonic() - tic
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        said = [l for l in (second.stdout + second.stderr).splitlines() if f"{run} is in use by another run (pid" in l]
        assert said and "choose another --adapter-path" in said[0], second.stdout[-2000:] + second.stderr[-2000:]
        assert "loading model" not in second.stdout and took < 60
        assert first.proc.poll() is None  # the holder trains on, untouched
        first.proc.send_signal(signal.SIGTERM)
        code, _ = first.finish()
        assert code == 3, first.output()[-2000:]
    finally:
        if first.proc.poll() is None:
            first.kill()
    assert not (run / ".meshtune.lock").exists()  # released at the end


def test_a_lock_left_by_a_killed_run_is_taken_over_and_its_temp_files_cleaned(tmp_path):
    run = tmp_path / "run"
    args = train_args(run, iters=LONG, save_every=2)
    first = FaultRun([*CLI, *args])
    try:
        _wait_training(run, first.proc, reports=5)
        first.proc.send_signal(signal.SIGKILL)
        first.finish()
    finally:
        if first.proc.poll() is None:
            first.kill()
    assert (run / ".meshtune.lock").exists()
    (run / ".adapters.safetensors.tmp-12345.safetensors").write_bytes(b"a save cut by SIGKILL")
    resumed = run_cli(*train_args(run, iters=8, save_every=2, extra=("--resume",)))
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-3000:]
    assert f"note: taking over {run / '.meshtune.lock'}, left by a run that ended without releasing it (pid " \
        f"{first.proc.pid} on " in out, out[-3000:]
    assert "note: removed 1 unfinished temp file" in out
    assert not list(run.glob(".*.tmp-*")) and not (run / ".meshtune.lock").exists()


def test_two_launchers_started_together_each_keep_their_own_ring(tmp_path):
    runs = [tmp_path / "a", tmp_path / "b"]
    procs = [subprocess.Popen([*CLI, "launch", "-n", "2", "--", *CLI, *train_args(r, iters=6, save_every=3)],
                              env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in runs]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    for r in runs:
        assert sorted(c.name for c in (r / "checkpoints").iterdir()) == ["0000003", "0000006"]


def test_overwrite_that_dies_before_its_first_save_leaves_no_mix(tmp_path):
    """The earlier run (rank 8) is gone whole before the new one (rank 4) writes its config: a run killed
    before its first save leaves the new config alone, never the old adapters beside it."""
    run = tmp_path / "run"
    assert run_cli(*train_args(run, iters=2, save_every=2, extra=("--adapter.rank", "8"))).returncode == 0
    assert (run / "adapters.safetensors").exists()
    args = train_args(run, iters=LONG, save_every=LONG, extra=("--adapter.rank", "4", "--output.overwrite", "true"))
    second = FaultRun([*CLI, *args])
    try:
        deadline = time.monotonic() + 120
        while not (second.wait_for(r"step 2: train loss") and sum(r["type"] == "train" for r in _records(run)) >= 2):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        second.proc.send_signal(signal.SIGKILL)
        second.finish()
    finally:
        if second.proc.poll() is None:
            second.kill()
    config = json.loads((run / "adapter_config.json").read_text())
    assert config["lora_parameters"]["rank"] == 4
    assert not (run / "adapters.safetensors").exists() and not (run / "checkpoints").exists()
    assert not (run / "report.md").exists() and not list(run.glob(".earlier-run-*"))


def test_a_folder_holding_only_metrics_is_an_earlier_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"type": "train", "step": 1, "loss": 2.0}) + "\n")
    proc = run_cli(*train_args(run, iters=2, save_every=2))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"output.adapter_path={run} already holds a run (metrics.jsonl); pass --resume" in proc.stderr
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_a_dangling_adapter_path_link_is_one_line_before_the_model_loads(tmp_path):
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "gone")
    proc = run_cli(*train_args(link, iters=2, save_every=2))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"meshtune: error: output.adapter_path={link} is a symbolic link to {tmp_path / 'gone'}, which does not "
        "exist; create that folder, remove the link, or choose another --adapter-path"]
    assert "loading model" not in proc.stdout
