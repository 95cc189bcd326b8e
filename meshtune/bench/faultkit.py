"""Tools for fault runs: a training run as a real process tree, and ways to hurt it.

`FaultRun` starts `meshtune launch -n N -- meshtune train ...` (or one rank of a run
started without the launcher), reads its merged output on a thread, learns each
rank's pid from the line every rank prints at start, and lets a caller wait for a
step, signal a rank and time how long the whole tree takes to exit. `survivors`
finds any process still holding the run's folder on its command line, so a test can
show that nothing was left behind. `Bench` holds what every case of `meshtune bench faults`
shares (its settings, the uninterrupted 2-rank reference run, resuming and comparing) and
`Outcome` one case's row. Used by `meshtune bench faults` and the tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx

from ..run_dir import RunDir

CLI = [sys.executable, "-m", "meshtune.cli"]
RANK_PID = re.compile(r"\[rank (\d+)\] rank \d+ of \d+: .*\(pid (\d+)\)")


def train_args(out: Path, *, iters: int, batch: int = 6, save_every: int = 4, watchdog_s: float = 5.0,
               extra: tuple[str, ...] = ()) -> list[str]:
    """`meshtune train` on the embedded tiny model and arithmetic data, SGD, no eval.

    SGD: the update is the gradient itself, so weights compare the sums of gradients
    (tests/*/test_data_parallel.py says why Adam would blur a cross-layout comparison);
    lr 0.01, since at 0.05 SGD is unstable here and amplifies float rounding ~1000x.
    """
    return ["train", "--iters", str(iters), "--batch-size", str(batch), "--save-every", str(save_every),
            "--steps-per-eval", "100000", "--train.val_batches", "0", "--train.steps_per_report", "1",
            "--optimizer", "sgd", "--learning-rate", "0.01", "--runtime.watchdog_s", str(watchdog_s),
            "--adapter-path", str(out), *extra]


def env() -> dict[str, str]:
    """This process's environment with the package importable in the children."""
    root = str(Path(__file__).resolve().parents[2])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))


class FaultRun:
    """A process (tree) whose output is collected line by line on a thread."""

    def __init__(self, argv: list[str], environ: dict[str, str] | None = None) -> None:
        self.lines: list[str] = []
        self.pids: dict[int, int] = {}
        self._new = threading.Condition()
        self.proc = subprocess.Popen(argv, env=environ or env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, errors="replace")
        self.fault_at: float | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def launch(cls, n: int, args: list[str], launcher_args: tuple[str, ...] = ()) -> "FaultRun":
        return cls([*CLI, "launch", "-n", str(n), *launcher_args, "--", *CLI, *args])

    def _read(self) -> None:
        for raw in self.proc.stdout:
            for line in raw.replace("\r", "\n").splitlines():  # progress bars redraw with \r
                if m := RANK_PID.search(line):
                    self.pids[int(m.group(1))] = int(m.group(2))
                with self._new:
                    self.lines.append(line)
                    self._new.notify_all()
        with self._new:
            self._new.notify_all()

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        """The first output line matching `pattern`; ValueError with the output tail if none comes."""
        rx, seen, deadline = re.compile(pattern), 0, time.monotonic() + timeout
        with self._new:
            while True:
                for line in self.lines[seen:]:
                    if m := rx.search(line):
                        return m
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise ValueError(f"no line matching {pattern!r}; output tail:\n" + "\n".join(self.lines[-30:]))
                self._new.wait(min(left, 0.5))

    def hurt(self, rank: int, sig: int) -> None:
        """Send `sig` to one rank and start the clock."""
        os.kill(self.pids[rank], sig)
        self.fault_at = time.monotonic()

    def finish(self, timeout: float = 120) -> tuple[int, float]:
        """(exit code, seconds from the fault to the exit of the whole tree)."""
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code, time.monotonic() - (self.fault_at or time.monotonic())

    def output(self) -> str:
        return "\n".join(self.lines)

    def kill(self) -> None:
        """Clean-up for a test that failed half way: the tree and every rank it named."""
        for pid in [self.proc.pid, *self.pids.values()]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait()


def survivors(marker: str) -> list[int]:
    """Pids of live processes whose command line contains `marker` (zombies have none)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def max_abs_diff(a: Path, b: Path) -> float:
    """Largest |a - b| over every tensor of two adapter files (inf if their keys differ)."""
    wa, wb = mx.load(str(a)), mx.load(str(b))
    if wa.keys() != wb.keys():
        return float("inf")
    return max(float(mx.abs(wa[k].astype(mx.float32) - wb[k].astype(mx.float32)).max()) for k in wa)


BATCH, SAVE_EVERY, FAULT_AFTER = 6, 4, 6


@dataclass
class Outcome:
    case: str
    ranks: int
    exit_code: int | None
    seconds_to_exit: float | None
    message: str
    left_running: int
    resumed_on: int
    max_abs_diff: float | None
    reproduced: str  # "exact", "within tol", "NO", or why it was not checked
    ok: bool
    note: str = ""


class Bench:
    """One temp folder, the shared settings and the 2-rank reference run."""

    def __init__(self, root: Path, iters: int, watchdog_s: float) -> None:
        self.root, self.iters, self.watchdog_s = root, iters, watchdog_s

    def args(self, out: Path, *extra: str, save_every: int = SAVE_EVERY) -> list[str]:
        return train_args(out, iters=self.iters, batch=BATCH, save_every=save_every, watchdog_s=self.watchdog_s,
                          extra=extra)

    def train(self, n: int, out: Path, *extra: str, save_every: int = SAVE_EVERY) -> subprocess.CompletedProcess:
        argv = [*CLI, "launch", "-n", str(n), "--", *CLI, *self.args(out, *extra, save_every=save_every)]
        proc = subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[-12:])} failed ({proc.returncode}): {proc.stderr[-1500:]}")
        return proc

    def reference(self) -> Path:
        out = self.root / "reference"
        if not RunDir(out).adapters.exists():
            self.train(2, out)
        return RunDir(out).adapters

    def resume(self, out: Path, n: int = 2, save_every: int = SAVE_EVERY) -> tuple[float, str, list[str]]:
        """--resume on n ranks; (max abs diff to the reference, verdict, warning lines said)."""
        proc = self.train(n, out, "--resume", save_every=save_every)
        warnings = [l.split("] ", 1)[-1] for l in proc.stdout.splitlines() if "warning: skipping checkpoint" in l]
        diff = max_abs_diff(RunDir(out).adapters, self.reference())
        a, b = mx.load(str(RunDir(out).adapters)), mx.load(str(self.reference()))
        close = all(mx.allclose(a[k], b[k], rtol=1e-4, atol=1e-5).item() for k in a)
        return diff, "exact" if diff == 0 else "within tol" if close else "NO", warnings


def through_fault(b: Bench, run: FaultRun, hurt: Callable[[], None], after: int = FAULT_AFTER) -> tuple[int, float]:
    """Wait for step `after`, `hurt` the run, wait for its end: (exit code, seconds after the fault)."""
    try:
        run.wait_for(rf"step {after}: train loss")
        hurt()
        run.fault_at = run.fault_at or time.monotonic()
        return run.finish(timeout=b.watchdog_s + 60)
    finally:
        if run.proc.poll() is None:
            run.kill()
