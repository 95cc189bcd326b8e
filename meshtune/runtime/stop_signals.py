"""SIGTERM and SIGINT (Ctrl-C, a scheduler's stop) taken as requests: recorded while inside, the old
handlers back on exit. A run holds one for its whole life, set-up and report included: the training
loop saves and stops on the first (training/loop.py), and a later one only adds to the record, so it
never interrupts a save or the report. meshtune launch passes one on to its ranks (parallel/launcher.py)."""

from __future__ import annotations

import signal
from typing import Any


class StopSignals:
    """Inside, each SIGTERM/SIGINT is appended to `signals`; nothing is raised. Off the main thread,
    signals are left alone."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self._old: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return bool(self.signals)

    def name(self) -> str:
        """The first signal's name (SIGINT, SIGTERM); "" when none came."""
        return signal.Signals(self.signals[0]).name if self.signals else ""

    def _handle(self, signum: int, frame: Any) -> None:
        self.signals.append(signum)

    def __enter__(self) -> "StopSignals":
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def keep_until_exit(self) -> None:
        """Ignore SIGTERM/SIGINT from now to the process's end, not restoring the old actions: for a process
        that has stopped on request and is about to end, where a late signal (a launcher passing on one its
        rank already acted on) would kill it and change its exit code. Ignored, not recorded: Python resets
        a handler of its own to the default action as it shuts down, but leaves an ignored signal ignored."""
        for sig in self._old:
            signal.signal(sig, signal.SIG_IGN)
        self._old.clear()

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
