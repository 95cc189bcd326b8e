"""A disk that fills up during a run, on a real small file system (a tmpfs; skipped where it cannot be mounted):
the run ends with one line naming the room a save needs and the last good checkpoint, every record of
metrics.jsonl is whole, the checkpoint it names verifies and resumes once space is made."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from meshtune.bench.faultkit import CLI, FaultRun, env, train_args
from meshtune.training.checkpoint import verify_checkpoint


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MB tmpfs: room for the pre-run check (two checkpoints and the adapters) and a few saves more."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4000k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.decode().strip()})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def _assert_whole_records(run) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]  # any cut record raises here


def _last_good(line: str) -> str:
    return line.split("last good checkpoint: ")[1].split(" (resume")[0]


def test_a_disk_filled_by_the_saves_ends_with_one_line_and_resumes(small_disk):
    run = small_disk / "run"
    proc = subprocess.run([*CLI, *train_args(run, iters=60, save_every=1)], env=env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [l for l in proc.stderr.splitlines() if l.startswith("meshtune: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "No space left on device" in errors[0] and "a save needs about" in errors[0], errors[0]
    good = _last_good(errors[0])
    assert verify_checkpoint(Path(good)) is None
    _assert_whole_records(run)
    for old in sorted((run / "checkpoints").iterdir())[:-1]:  # make room: keep the newest only
        subprocess.run(["rm", "-rf", str(old)], check=True)
    resumed = subprocess.run([*CLI, *train_args(run, iters=int(good[-7:]) + 2, save_every=1,
                                                extra=("--resume", "--output.keep_last_n", "1"))],
                             env=env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resumed from step {int(good[-7:])}" in resumed.stdout


def test_a_disk_filled_between_saves_cuts_no_record(small_disk):
    run = small_disk / "run"
    first = FaultRun([*CLI, *train_args(run, iters=100000, save_every=2)])
    try:
        first.wait_for(r"step 3: train loss")
        filler = small_disk / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=4k"], capture_output=True)  # until the disk is full
        code, _ = first.finish(timeout=120)
    finally:
        if first.proc.poll() is None:
            first.kill()
    out = first.output()
    assert code == 2, out[-3000:]
    errors = [l for l in out.splitlines() if l.startswith("meshtune: error:")]
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert "No space left on device" in errors[0] and "last good checkpoint: " in errors[0], errors[0]
    records = _assert_whole_records(run)
    assert records and records[-1]["step"] >= 3
