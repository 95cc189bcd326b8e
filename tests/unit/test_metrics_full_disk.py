"""A full disk mid-run: metrics.jsonl keeps whole records only, report.md and loss.png are written whole or not
at all, and each failure is one line (training/metrics.py, report.py)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from meshtune.training import metrics as metrics_module
from meshtune.report import write_report
from meshtune.run_dir import METRICS_FILE, PLOT_FILE, REPORT_FILE
from meshtune.training.metrics import MetricsWriteError, Reporter, read_metrics


def _disk_full_after(monkeypatch, module, room: int) -> None:
    """os.write in `module` takes `room` more bytes, then fails as a full disk does (part of a write first)."""
    real = os.write
    left = [room]

    def write(fd, data):
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real(fd, bytes(data[:left[0]]))
        left[0] -= n
        return n

    monkeypatch.setattr(module.os, "write", write)


def test_a_full_disk_leaves_only_whole_records_and_says_one_line(tmp_path: Path, monkeypatch) -> None:
    with Reporter(tmp_path, total_steps=10, log=lambda line: None, show_progress=False) as reporter:
        reporter.note("start", 0, None)
        reporter.train(1, loss=2.0, tokens=10, seconds=1.0, steps=1, learning_rate=1e-5, trained_tokens=10)
        whole = (tmp_path / METRICS_FILE).read_bytes()
        _disk_full_after(monkeypatch, metrics_module, 40)  # the next record is cut 40 bytes in
        with pytest.raises(MetricsWriteError) as full:
            reporter.train(2, loss=1.9, tokens=10, seconds=1.0, steps=1, learning_rate=1e-5, trained_tokens=20)
    line = str(full.value)
    assert "\n" not in line and "No space left on device" in line and "free disk space there" in line
    assert (tmp_path / METRICS_FILE).read_bytes() == whole  # the 40 bytes went again
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]


def test_a_report_the_disk_cannot_hold_leaves_the_earlier_one_whole(tmp_path: Path, monkeypatch) -> None:
    records = [{"type": "start", "step": 0, "time": 0.0},
               {"type": "train", "step": 1, "loss": 2.0, "tokens": 10, "tokens_per_sec": 10.0, "time": 1.0,
                "learning_rate": 1e-5, "trained_tokens": 10, "peak_memory_gb": 0.1}]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    write_report(tmp_path)
    before = (tmp_path / REPORT_FILE).read_bytes()

    def full(self, text, *args, **kwargs):
        self.write_bytes(text.encode()[:10])  # part of it lands, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError):
        write_report(tmp_path)
    assert (tmp_path / REPORT_FILE).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([METRICS_FILE, REPORT_FILE, PLOT_FILE])
