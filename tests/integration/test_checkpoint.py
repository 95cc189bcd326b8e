"""Checksummed checkpoints: damaged ones are skipped on resume, pruning, crash safety, full disks."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from support import ROOT
from meshtune.training.checkpoint import (CheckpointWriteError, TrainingState, list_checkpoints, load_checkpoint,
                                          resumable_checkpoint, save_checkpoint, verify_checkpoint)


def _save(run: Path, step: int, keep: int = 0) -> Path:
    trainable = {"w": mx.full((16, 8), float(step))}
    return save_checkpoint(run, state=TrainingState(step=step, data_cursor={"epoch": 0, "position": step}),
                           trainable=trainable, optimizer_state={"m": {"w": mx.zeros((16, 8))}},
                           config={"train": {"iters": 9}}, keep=keep)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_manifest_records_size_and_sha256_of_every_file(tmp_path):
    path = _save(tmp_path, 3)
    files = json.loads((path / "state.json").read_text())["files"]
    assert set(files) == {"adapters.safetensors", "optimizer.safetensors", "config.yaml"}
    for name, record in files.items():
        # Measured here, not by ck.file_record (the code that wrote the manifest).
        data = (path / name).read_bytes()
        assert record == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert verify_checkpoint(path) is None


DAMAGE = {
    "flipped byte": (lambda p: _flip_byte(p / "adapters.safetensors"), "sha256"),
    "truncated file": (lambda p: (p / "optimizer.safetensors").write_bytes(
        (p / "optimizer.safetensors").read_bytes()[:40]), "bytes, the manifest says"),
    "missing file": (lambda p: (p / "config.yaml").unlink(), "config.yaml is missing"),
    "unparsable manifest": (lambda p: (p / "state.json").write_text('{"step": 6,'), "state.json is unreadable"),
    "missing manifest": (lambda p: (p / "state.json").unlink(), "no state.json"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_latest_is_skipped_with_a_line_and_the_earlier_used(tmp_path, damage):
    _save(tmp_path, 3)
    latest = _save(tmp_path, 6)
    harm, why = DAMAGE[damage]
    harm(latest)
    lines: list[str] = []
    found = resumable_checkpoint(tmp_path, lines.append)
    assert found == tmp_path / "checkpoints" / "0000003"
    assert len(lines) == 1 and str(latest) in lines[0] and why in lines[0], lines
    assert load_checkpoint(found).state.step == 3


def test_leftover_temp_folder_is_named_and_ignored(tmp_path):
    _save(tmp_path, 3)
    leftover = tmp_path / "checkpoints" / ".0000006.tmp-abc"
    leftover.mkdir()
    (leftover / "adapters.safetensors").write_bytes(b"partial")
    lines: list[str] = []
    assert resumable_checkpoint(tmp_path, lines.append).name == "0000003"
    assert len(lines) == 1 and str(leftover) in lines[0] and "interrupted save" in lines[0]
    _save(tmp_path, 4)  # the next good save clears it
    assert not leftover.exists()


def test_nothing_intact_gives_none(tmp_path):
    _flip_byte(_save(tmp_path, 3) / "adapters.safetensors")
    lines: list[str] = []
    assert resumable_checkpoint(tmp_path, lines.append) is None and len(lines) == 1


def test_keep_last_n_prunes_older_after_each_save(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep=2)
        assert [int(p.name) for p in list_checkpoints(tmp_path)] == list(range(max(1, step - 1), step + 1))


def test_keep_last_n_never_deletes_the_one_just_written(tmp_path):
    _save(tmp_path, 3)
    _flip_byte(_save(tmp_path, 6) / "adapters.safetensors")  # damaged: a resume goes back to 3
    _save(tmp_path, 4, keep=1)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["0000004", "0000006"]  # 3 pruned; 6 left for the run to overwrite
    assert resumable_checkpoint(tmp_path, lambda line: None).name == "0000004"


def test_keep_last_n_is_a_validated_output_option():
    from meshtune.config import Config, ConfigError, field_help

    assert Config().output.keep_last_n == 0 and "keeps all" in field_help("output", "keep_last_n")
    cfg = Config.from_dict({"output": {"keep_last_n": -2}})
    with pytest.raises(ConfigError, match="output.keep_last_n"):
        cfg.validate()


def test_failed_save_names_folder_removes_temp_and_keeps_last_good(tmp_path, monkeypatch):
    good = _save(tmp_path, 3)
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    real = mx.save_safetensors

    def fail_on_optimizer(path, arrays, metadata=None):
        if "optimizer" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, arrays, metadata=metadata)

    monkeypatch.setattr(mx, "save_safetensors", fail_on_optimizer)
    with pytest.raises(CheckpointWriteError) as err:
        _save(tmp_path, 6)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / "checkpoints") in message
    assert "No space left on device" in message and "free disk space" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["0000003"]
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before


def test_silently_truncated_write_is_caught(tmp_path, monkeypatch):
    """MLX does not report a full disk: a short file must still fail the save."""
    real = mx.save_safetensors

    def short_write(path, arrays, metadata=None):
        real(path, arrays, metadata=metadata)
        Path(path).write_bytes(Path(path).read_bytes()[:-10])

    monkeypatch.setattr(mx, "save_safetensors", short_write)
    with pytest.raises(CheckpointWriteError, match="incomplete"):
        _save(tmp_path, 3)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_sigkill_during_saves_always_leaves_a_loadable_latest(tmp_path):
    rng = random.Random(0)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    worker = [sys.executable, str(ROOT / "tests" / "integration" / "ckpt_worker.py"), str(tmp_path)]
    kills = 0
    for _ in range(8):
        proc = subprocess.Popen(worker, env=env, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        if kills == 0:
            assert proc.stdout.readline().startswith("saved")  # at least one save before the first kill
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        kills += 1
        found = resumable_checkpoint(tmp_path, lambda line: None)
        newest = list_checkpoints(tmp_path)[-1]
        assert found == newest, f"after kill {kills}: newest complete {newest} failed verification"
        loaded = load_checkpoint(found)
        assert loaded.state.step == int(found.name)
        assert mx.all(loaded.trainable["a"] == loaded.state.step).item()
        assert mx.all(loaded.optimizer_state["m"]["a"] == loaded.state.step).item()
    assert int(found.name) > 1
