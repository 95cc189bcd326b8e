"""Token-weighted losses, throughput windows and where reports go.

Losses are sums of per-token cross entropy divided by the token count over all
ranks and micro-batches, so 1 rank and N ranks report the same number for the same
global batch. Reports go to `metrics.jsonl` (one JSON object per line), to the
trackers of `output.report_to` (training/trackers.py) and as one line each to the log
function; on a terminal a progress bar (loss, tokens/s, peak memory, ETA) stands
below the lines, never in a file or pipe. Only the writer rank writes. Each record is
appended whole or not at all: a write that fails part way (a full disk) is cut back to
the file's length before it, and the run stops with one line (MetricsWriteError).
"""

from __future__ import annotations

import errno
import json
import os
import warnings
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from tqdm import tqdm

from ..run_dir import RunDir


def peak_memory_per_rank(mesh: Any) -> list[float]:
    """Every rank's peak memory in GB, in rank order: a collective over the whole world (every rank calls it).

    Bytes travel as two int32 slots per rank (MiB and the rest, one Mesh.all_rows), so the sums are exact.
    """
    peak = mx.get_peak_memory()
    if mesh.world_size == 1:
        return [peak / 1e9]
    mib, rest = divmod(peak, 2**20)
    return [(m * 2**20 + r) / 1e9 for m, r in mesh.all_rows([mib, rest])]


def wait_shares(mesh: Any, waited: dict[str, float], seconds: float) -> dict[str, float]:
    """`{kind}_share` for each kind of Strategy.take_waits(): each rank's seconds waited over its window's
    step seconds, the mean over ranks (a world all_sum where there is more than one rank; every rank calls it)."""
    if not waited:
        return {}
    kinds = sorted(waited)
    own = mx.array([min(waited[k] / max(seconds, 1e-9), 1.0) for k in kinds], dtype=mx.float32)
    means = (mesh.all_sum(own) / mesh.world_size).tolist() if mesh.world_size > 1 else own.tolist()
    return {f"{k}_share": v for k, v in zip(kinds, means)}


@dataclass
class Window:
    """Accumulates one report window's loss sum, tokens, steps and compute time."""

    loss_sum: Any = 0.0
    tokens: Any = 0
    steps: int = 0
    seconds: float = 0.0
    applied: int = 0  # steps whose update was applied (the loop counts them); skipped ones add no loss

    def add(self, loss_sum: mx.array, tokens: mx.array) -> None:
        """Count one micro-batch's loss sum and tokens (lazy arrays)."""
        self.loss_sum = self.loss_sum + loss_sum
        self.tokens = self.tokens + tokens

    def end_step(self, seconds: float) -> None:
        """Close one optimizer step that took `seconds`."""
        self.steps += 1
        self.seconds += seconds


def report_window(reporter: "Reporter", window: Window, mesh: Any, step: int, *, learning_rate: float,
                  trained_tokens: int, waited: dict[str, float]) -> tuple[float, int]:
    """Report one window: its loss and tokens summed over the ranks, the ranks' peaks and waits.

    Returns (the window's token-weighted loss, trained tokens so far including the window's)."""
    tokens = int(mesh.all_sum(window.tokens).item())
    loss = mesh.all_sum(window.loss_sum).item() / max(tokens, 1)
    trained_tokens += tokens
    reporter.train(step, loss=loss, tokens=tokens, seconds=window.seconds, steps=window.steps,
                   learning_rate=learning_rate, trained_tokens=trained_tokens, peaks=peak_memory_per_rank(mesh),
                   shares=wait_shares(mesh, waited, window.seconds))
    return loss, trained_tokens


class MetricsWriteError(ValueError):
    """metrics.jsonl could not take a record (disk full, folder gone); the file ends at its last whole record."""


def append_record(fd: int, line: bytes, path: Path) -> None:
    """Append one whole line to the file open as `fd` (O_APPEND), or raise MetricsWriteError leaving the
    file as it was: a part written before the failure is cut off again."""
    before = os.fstat(fd).st_size
    try:
        done = 0
        while done < len(line):
            done += os.write(fd, line[done:])
    except OSError as err:
        try:
            os.ftruncate(fd, before)
        except OSError:
            pass
        why = err.strerror or str(err)
        fix = "free disk space there" if err.errno in (errno.ENOSPC, errno.EDQUOT) else "make it writable"
        raise MetricsWriteError(f"cannot append to {path} ({why}); {fix}, then --resume from the last good "
                                "checkpoint; the file ends at its last whole record") from None


@dataclass
class Reporter:
    """Writes metrics.jsonl and drives the progress bar; silent on non-writer ranks."""

    out_dir: Path | None
    total_steps: int
    start_step: int = 0
    writer: bool = True
    log: Callable[[str], None] = print
    show_progress: bool = True  # on a terminal only: in a file each frame would be a line
    trackers: list[Any] = field(default_factory=list)  # training/trackers.py, closed on exit
    terminal: Any = None  # where the bar draws, if a terminal (None: this process's stderr)
    _bar: Any = field(default=None, init=False)
    _file: Any = field(default=None, init=False)

    def __enter__(self) -> "Reporter":
        if self.writer and self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._file = os.open(RunDir(self.out_dir).metrics, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.terminal = self.terminal or sys.stderr
        if self.writer and self.show_progress and self.terminal.isatty():
            self._bar = tqdm(total=self.total_steps, initial=self.start_step, unit="step",
                             dynamic_ncols=True, file=self.terminal, leave=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            os.close(self._file)
        for tracker in self.trackers:
            tracker.close()

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def emit(self, record: dict[str, Any], line: str | None) -> None:
        """Append one JSON record and print its human line (above the bar; None: no line)."""
        if not self.writer:
            return
        if self._file is not None:
            append_record(self._file, (json.dumps(record) + "\n").encode(), RunDir(self.out_dir).metrics)
        for tracker in self.trackers:
            tracker.log(record)
        if line is None:
            return
        if self._bar is not None:
            self._bar.write(line, file=self.terminal)
            if record.get("type") == "train":
                self._bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}",
                                      mem=f"{record['peak_memory_gb']:.2f}GB", refresh=False)
        else:
            self.log(line)

    def train(self, step: int, *, loss: float, tokens: int, seconds: float, steps: int,
              learning_rate: float, trained_tokens: int, peaks: list[float] | None = None,
              shares: dict[str, float] | None = None) -> dict[str, Any]:
        """One train report. `peaks`: every rank's peak memory in GB (peak_memory_per_rank), else this
        rank's; `shares`: the window's comm_share / bubble_share (wait_shares)."""
        peaks = peaks or [mx.get_peak_memory() / 1e9]
        record = {
            "type": "train", "step": step, "loss": loss, "learning_rate": learning_rate,
            "tokens": tokens, "tokens_per_sec": tokens / max(seconds, 1e-9),
            "steps_per_sec": steps / max(seconds, 1e-9), "trained_tokens": trained_tokens,
            "peak_memory_gb": max(peaks), "peak_memory_gb_per_rank": peaks,
            "active_memory_gb": mx.get_active_memory() / 1e9,
            **(shares or {}), "time": time.time(),
        }
        waits = "".join(f", {k.removesuffix('_share')} {100 * v:.1f}%" for k, v in (shares or {}).items())
        self.emit(record, f"step {step}: train loss {loss:.4f}, lr {learning_rate:.3e}, "
                          f"{record['tokens_per_sec']:.0f} tok/s, peak mem {record['peak_memory_gb']:.3f} GB{waits}")
        return record

    def eval(self, step: int, *, split: str, loss: float, tokens: int, seconds: float) -> dict[str, Any]:
        record = {"type": split, "step": step, f"{split}_loss": loss, "tokens": tokens,
                  "seconds": seconds, "time": time.time()}
        self.emit(record, f"step {step}: {split} loss {loss:.4f} ({tokens} tokens, {seconds:.1f}s)")
        return record

    def note(self, kind: str, step: int, line: str | None, **extra: Any) -> None:
        self.emit({"type": kind, "step": step, "time": time.time(), **extra}, line)


def read_metrics(out_dir: Path) -> list[dict[str, Any]]:
    """All records of a run's metrics.jsonl. A last line cut off mid-write (a crash, a full disk) is
    left out with a warning; any other line that is not a JSON object is an error naming it."""
    path = RunDir(out_dir).metrics
    lines = path.read_text().splitlines()
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if n == len(lines):
                warnings.warn(f"{path}:{n}: an incomplete last record (cut off mid-write) is left out")
                continue
            raise ValueError(f"{path}:{n}: not a JSON record; remove the line (or the file, to report afresh)") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{n}: not a JSON object; remove the line")
        records.append(record)
    return records
