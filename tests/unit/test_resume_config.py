"""--resume takes every section from the checkpoint, flags given now win, and the messages name the flag as typed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from meshtune.config import Config, ConfigError, load_config, parse_override_args
from meshtune.config.load import flag_spellings
from meshtune.config.resume import resume_config, saved_run_config

# A PP 2 run with every launch-independent setting away from its default.
SAVED_FLAGS = ["--data", "d", "--iters", "4", "--batch-size", "8", "--parallel.pp", "2",
               "--parallel.schedule", "gpipe", "--parallel.micro_batches", "4", "--parallel.stage_layers", "[3, 1]",
               "--parallel.transport", "sockets", "--parallel.grad_sync", "overlap", "--parallel.bucket_mb", "10",
               "--output.report_to", "tensorboard", "--output.project_name", "p", "--output.keep_last_n", "2",
               "--runtime.watchdog_s", "30", "--runtime.fast_cpu_activations", "false",
               "--runtime.overlap_steps", "false", "--adapter-path", "elsewhere"]


def _saved_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "checkpoints" / "0000004").mkdir(parents=True)
    saved = load_config(None, SAVED_FLAGS).to_dict()
    (run / "checkpoints" / "0000004" / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    return run


def _resume(run: Path, *flags: str):
    items = parse_override_args(["--adapter-path", str(run), "--output.resume", "true", *flags])
    return resume_config(load_config(None, items), *saved_run_config(run), spelled=flag_spellings(items))


def test_every_section_comes_from_the_checkpoint_but_where_this_launch_writes(tmp_path: Path) -> None:
    run = _saved_run(tmp_path)
    cfg = _resume(run)
    expected = load_config(None, SAVED_FLAGS).to_dict()
    expected["output"].update(adapter_path=str(run), resume=True)
    assert cfg.to_dict() == expected  # pp 2, gpipe, report_to, keep_last_n, the runtime: all kept
    assert cfg.notes == []
    assert cfg.origins["parallel.pp"] == str(run / "checkpoints" / "0000004" / "config.yaml")


def test_flags_given_now_override_with_one_note_for_the_layout(tmp_path: Path) -> None:
    run = _saved_run(tmp_path)
    cfg = _resume(run, "--parallel.pp", "1", "--runtime.watchdog_s", "5", "--output.keep_last_n", "0")
    p = cfg.parallel
    assert (p.pp, p.pipeline_stages, p.stage_layers) == (1, 0, None)  # the stages' split follows pp
    assert (p.schedule, p.micro_batches, p.transport, p.grad_sync, p.bucket_mb) == ("gpipe", 4, "sockets",
                                                                                    "overlap", 10.0)
    assert (cfg.runtime.watchdog_s, cfg.output.keep_last_n, cfg.output.report_to) == (5.0, 0, "tensorboard")
    assert cfg.notes == ["resuming with parallel.pp 1 (the run had 2), parallel.stage_layers null "
                         "(the run had [3, 1])"]
    cfg.validate(world_size=1)  # runs in one process
    staged = _resume(run, "--parallel.pipeline_stages", "4", "--parallel.stage_layers", "[1, 1, 1, 1]")
    assert (staged.parallel.pp, staged.parallel.stage_layers) == (4, [1, 1, 1, 1])
    assert staged.notes == ["resuming with parallel.pp 4 (the run had 2), parallel.pipeline_stages 4 (the run had 0), "
                            "parallel.stage_layers [1, 1, 1, 1] (the run had [3, 1])"]


def test_a_saved_layout_this_world_cannot_run_names_the_flag(tmp_path: Path) -> None:
    run = _saved_run(tmp_path)
    with pytest.raises(ConfigError) as e:
        _resume(run).validate(world_size=1)
    assert e.value.problems == [f"{run}/checkpoints/0000004/config.yaml: parallel.pp = 2: does not divide the "
                                "world size 1; give --parallel.pp 1"]
    with pytest.raises(ConfigError, match=r"does not divide the world size 3; give --parallel.pp N, N one of \[1, 3\]"):
        _resume(run).validate(world_size=3)


@pytest.mark.parametrize("flags, drop", [
    (["--learning-rate", "1e-3"], "drop --learning-rate"),
    (["--optimizer.learning_rate=1e-3"], "drop --optimizer.learning_rate"),
    (["--data.mask-prompt"], "drop --data.mask-prompt"),
    (["--mask-prompt"], "drop --mask-prompt"),
])
def test_a_changed_setting_names_the_flag_as_typed(tmp_path: Path, flags: list[str], drop: str) -> None:
    run = _saved_run(tmp_path)
    with pytest.raises(ConfigError) as e:
        _resume(run, *flags)
    assert len(e.value.problems) == 1 and f"; {drop} to resume with the run's own settings" in e.value.problems[0]


def test_a_changed_setting_from_a_file_names_the_file(tmp_path: Path) -> None:
    run = _saved_run(tmp_path)
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  path: d\ntrain:\n  batch_size: 16\n")
    given = load_config(path, [("--adapter-path", str(run)), ("output.resume", "true")])
    with pytest.raises(ConfigError) as e:
        resume_config(given, *saved_run_config(run))
    assert e.value.problems[0].startswith(f"{path}:4: --resume: train.batch_size = 16 differs from the checkpoint's 8")
    assert f"; remove train.batch_size from {path} to resume" in e.value.problems[0]


def test_train_config_says_the_layout_note(tmp_path: Path) -> None:
    from meshtune.cli.commands import _train_config

    run = _saved_run(tmp_path)
    said: list[str] = []
    cfg = _train_config(argparse.Namespace(config=None, resume=True), ["--adapter-path", str(run), "--parallel.pp",
                                                                       "1"], say=said.append)
    assert cfg.parallel.pp == 1 and cfg.output.report_to == "tensorboard"
    assert said[1:] == ["note: resuming with parallel.pp 1 (the run had 2), parallel.stage_layers null "
                        "(the run had [3, 1])"]


class _Mesh:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.is_writer = True


def test_resume_command_gives_the_launcher_of_a_multi_rank_run(tmp_path: Path) -> None:
    from meshtune.runtime.relaunch import resume_command

    run = tmp_path / "my run"
    train = f"meshtune train --adapter-path '{run}' --resume"
    assert resume_command(run, _Mesh(1), {}) == train
    assert resume_command(run, _Mesh(2), {}) == train  # no launcher: one process
    assert resume_command(run, _Mesh(2), {"MLX_RANK": "0"}) == f"meshtune launch -n 2 -- {train}"
    ring = tmp_path / "ring.json"  # what a launcher writes for its ranks: not the user's hostfile
    ring.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    env = {"MLX_RANK": "0", "MLX_HOSTFILE": str(ring)}
    assert resume_command(run, _Mesh(3), env) == f"meshtune launch -n 3 -- {train}"
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}]))
    env = {"MLX_RANK": "1", "MLX_HOSTFILE": str(hosts)}
    assert resume_command(run, _Mesh(2), env) == f"meshtune launch --hostfile {hosts} -- {train}"
    launched = {"MLX_RANK": "0", "MLX_HOSTFILE": str(ring), "MESHTUNE_LAUNCH_COMMAND":
                "meshtune launch --hostfile /abs/hosts.json"}  # meshtune launch --hostfile: its ranks see a ring file
    assert resume_command(run, _Mesh(2), launched) == f"meshtune launch --hostfile /abs/hosts.json -- {train}"


def test_a_stopped_multi_rank_run_says_the_launch_command(tmp_path: Path) -> None:
    from meshtune.api import RunResult
    from meshtune.cli.commands import continue_line

    run = tmp_path / "run"
    result = RunResult(adapter_path=run, step=7, train_loss=None, val_loss=None, test_loss=None,
                       trained_tokens=0, stopped_early=True)
    another_launcher = {"MLX_RANK": "0"}  # no MLX_HOSTFILE, no MESHTUNE_LAUNCH_COMMAND
    assert continue_line(result, _Mesh(4), another_launcher) == (
        f"to continue from step 7: meshtune launch -n 4 -- meshtune train --adapter-path {run} --resume")


def test_a_moved_folder_is_given_anew_and_a_present_one_must_match(tmp_path: Path, monkeypatch) -> None:
    """Runs save absolute paths: a project moved since takes --model/--data given now, with a note;
    a saved folder that still exists must be the one given."""
    from meshtune.config.resume import run_mismatches

    run = tmp_path / "run"
    (run / "checkpoints" / "0000004").mkdir(parents=True)
    gone, here = tmp_path / "old-place" / "data", tmp_path / "new-place" / "data"
    here.mkdir(parents=True)
    saved = load_config(None, ["--data", str(gone), "--iters", "4"]).to_dict()
    (run / "checkpoints" / "0000004" / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    monkeypatch.chdir(tmp_path / "new-place")
    cfg = _resume(run, "--data", "data")
    assert cfg.data.path == "data" and cfg.notes == [f"data.path: the checkpoint's {gone} no longer exists; using data"]
    assert run_mismatches(cfg.with_absolute_paths().to_dict(), saved) == []
    (gone).mkdir(parents=True)  # still there: another folder is a different run's data
    with pytest.raises(ConfigError, match=r"--resume: data.path = 'data' differs from the checkpoint's"):
        _resume(run, "--data", "data")
    assert run_mismatches(cfg.with_absolute_paths().to_dict(), saved) == ["data.path"]


def test_init_from_is_not_compared_on_resume(tmp_path: Path) -> None:
    """adapter.init_from seeds a fresh run only; a resumed run's weights come from its checkpoint."""
    from meshtune.config.resume import run_mismatches

    run = tmp_path / "run"
    (run / "checkpoints" / "0000004").mkdir(parents=True)
    saved = load_config(None, ["--data", "d", "--adapter.init_from", str(tmp_path / "gone")]).to_dict()
    (run / "checkpoints" / "0000004" / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    cfg = _resume(run, "--adapter.init_from", "elsewhere")
    assert cfg.adapter.init_from == "elsewhere"
    assert run_mismatches(cfg.to_dict(), saved) == []


def test_a_config_built_in_code_resumes_only_with_the_run_s_settings():
    """finetune(cfg) with output.resume, cfg built without the CLI: every run section compares with the
    checkpoint as a command's flags do (resume_config), train.iters alone may grow."""
    from meshtune.config.resume import run_mismatches

    saved = Config().to_dict()
    assert run_mismatches(Config.from_dict({"train": {"iters": saved["train"]["iters"] + 50}}).to_dict(), saved) == []
    changed = Config.from_dict({"optimizer": {"learning_rate": 3e-4}, "schedule": {"warmup": 7},
                                "train": {"batch_size": 2}}).to_dict()
    assert run_mismatches(changed, saved) == ["optimizer.learning_rate", "schedule.warmup", "train.batch_size"]
    other_layout = Config.from_dict({"parallel": {"pp": 2}, "runtime": {"watchdog_s": 9}}).to_dict()
    assert run_mismatches(other_layout, saved) == []  # a launch's own sections
