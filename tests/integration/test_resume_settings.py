"""`meshtune train --adapter-path X --resume` continues with the run's own output, parallel and runtime settings."""

from __future__ import annotations

import yaml

from meshtune.config import load_config
from support import ARITH_DATA

QUICK = ["--data", str(ARITH_DATA), "--train.val_batches", "0", "--steps-per-eval", "100", "--batch-size", "4"]


def test_resume_keeps_the_runs_keep_last_n_and_report_settings(tmp_path, cli):
    run = tmp_path / "run"
    first = cli("train", *QUICK, "--iters", "2", "--save-every", "1", "--output.keep_last_n", "1",
                "--output.project_name", "kept", "--adapter-path", str(run))
    assert first.returncode == 0, first.stderr[-2000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0000002"]
    resumed = cli("train", "--adapter-path", str(run), "--resume", "--iters", "4")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from step 2" in resumed.stdout and "note: resuming with parallel" not in resumed.stdout
    # keep_last_n 1 still applies: without it the resumed run would keep 0000002 to 0000004.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0000004"]
    saved = yaml.safe_load((run / "checkpoints" / "0000004" / "config.yaml").read_text())
    assert saved["output"]["keep_last_n"] == 1 and saved["output"]["project_name"] == "kept"


def _pipeline_checkpoint(tmp_path):
    """A run folder whose newest checkpoint says PP 2, GPipe, 4 micro-batches (only its config: no weights)."""
    run = tmp_path / "pp2"
    saved = load_config(None, [*QUICK, "--iters", "4", "--parallel.pp", "2", "--parallel.schedule", "gpipe",
                               "--parallel.micro_batches", "4", "--output.report_to", "tensorboard",
                               "--runtime.watchdog_s", "30", "--adapter-path", str(run)]).to_dict()
    (run / "checkpoints" / "0000002").mkdir(parents=True)
    (run / "checkpoints" / "0000002" / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    return run


def test_a_pipeline_run_resumes_as_a_pipeline_or_names_the_flag(tmp_path, cli):
    run = _pipeline_checkpoint(tmp_path)
    shown = cli("config", "--adapter-path", str(run), "--resume")
    assert shown.returncode == 0, shown.stderr[-2000:]
    cfg = yaml.safe_load(shown.stdout)
    assert (cfg["parallel"]["pp"], cfg["parallel"]["schedule"], cfg["parallel"]["micro_batches"]) == (2, "gpipe", 4)
    assert cfg["output"]["report_to"] == "tensorboard" and cfg["runtime"]["watchdog_s"] == 30.0
    # In one process the saved layout cannot run: one line naming the flag that resumes it here.
    alone = cli("train", "--adapter-path", str(run), "--resume")
    assert alone.returncode == 2
    assert alone.stderr.splitlines() == [
        f"meshtune: error: {run}/checkpoints/0000002/config.yaml: parallel.pp = 2: does not divide the world "
        "size 1; give --parallel.pp 1"]
    flagged = cli("config", "--adapter-path", str(run), "--resume", "--parallel.pp", "1")
    assert flagged.returncode == 0, flagged.stderr[-2000:]
    assert yaml.safe_load(flagged.stdout)["parallel"]["pp"] == 1
    assert "note: resuming with parallel.pp 1 (the run had 2)" in flagged.stderr.splitlines()
