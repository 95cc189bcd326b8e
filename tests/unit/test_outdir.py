"""The output folder is checked before training (writable, room for two checkpoints) and a
failed save mid-run is one line that keeps the last good checkpoint."""

from __future__ import annotations

import errno
from collections import namedtuple
from pathlib import Path

import mlx.core as mx

from meshtune.runtime import outdir
from meshtune.training.checkpoint import resumable_checkpoint, verify_checkpoint
from meshtune.cli import main

RUN = ["--no-system-blas", "train", "--iters", "6", "--batch-size", "8", "--save-every", "3",
       "--steps-per-eval", "100", "--train.val_batches", "1"]


def _run(capsys, *args: str) -> tuple[int, str, str]:
    from meshtune.runtime.fastmath import uninstall_fast_swiglu

    try:
        code = main([*RUN, *args])
    finally:
        uninstall_fast_swiglu()  # in-process runs patch mlx-lm; other tests expect it stock
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.strip()]
    assert "Traceback" not in err and lines and lines[-1].startswith("meshtune: error: "), err
    return lines[-1]


def test_path_under_a_file_fails_before_the_model_loads(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    code, out, err = _run(capsys, "--adapter-path", str(tmp_path / "file" / "run"))
    line = _one_error_line(err)
    assert code == 2 and "output.adapter_path=" in line and "is a file, not a folder" in line
    assert "loading model" not in out


def test_unwritable_folder_fails_before_the_model_loads(tmp_path, capsys, monkeypatch):
    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(outdir.tempfile, "TemporaryFile", refuse)
    code, out, err = _run(capsys, "--adapter-path", str(tmp_path / "run"))
    line = _one_error_line(err)
    assert code == 2 and f"cannot create files in {tmp_path}" in line and "Permission denied" in line
    assert "loading model" not in out and not (tmp_path / "run").exists()


def test_too_little_space_fails_before_step_1(tmp_path, capsys, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(outdir.shutil, "disk_usage", lambda p: usage(10 ** 9, 10 ** 9 - 1000, 1000))
    code, out, err = _run(capsys, "--adapter-path", str(tmp_path / "run"))
    line = _one_error_line(err)
    assert code == 2 and "free on the disk of" in line and "free space there" in line
    assert "step 1" not in out and not (tmp_path / "run").exists()


def test_space_estimate_counts_two_checkpoints():
    need = outdir.check_free_space(Path("."), trainable_bytes=1000, optimizer="adam")
    assert need == 2 * 3000 + 1000 + outdir.MARGIN_BYTES


def test_disk_full_mid_run_keeps_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    real, calls = mx.save_safetensors, []

    def full_at_second_checkpoint(path, arrays, metadata=None):
        if "0000006" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        calls.append(path)
        return real(path, arrays, metadata=metadata)

    monkeypatch.setattr(mx, "save_safetensors", full_at_second_checkpoint)
    code, out, err = _run(capsys, "--adapter-path", str(run))
    line = _one_error_line(err)
    assert code == 2 and str(run / "checkpoints") in line and "No space left on device" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0000003"]
    assert verify_checkpoint(run / "checkpoints" / "0000003") is None
    assert resumable_checkpoint(run, lambda l: None).name == "0000003"


def test_resume_skips_a_corrupt_latest_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    assert _run(capsys, "--adapter-path", str(run))[0] == 0
    bad = run / "checkpoints" / "0000006" / "adapters.safetensors"
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    code, out, err = _run(capsys, "--adapter-path", str(run), "--resume")
    assert code == 0, err
    skipped = [l for l in out.splitlines() if "skipping checkpoint" in l]
    assert len(skipped) == 1 and str(bad.parent) in skipped[0] and "sha256" in skipped[0]
    assert "resumed from step 3" in out
    assert verify_checkpoint(run / "checkpoints" / "0000006") is None  # rewritten by the resumed run
