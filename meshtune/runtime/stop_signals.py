"""SIGTERM and SIGINT (Ctrl-C, a scheduler's stop) taken as requests: recorded while inside, the old
handlers back on exit. The training loop saves and stops on one (training/loop.py); meshtune launch
passes one on to its ranks (parallel/launcher.py)."""

from __future__ import annotations

import signal
from typing import Any


class StopSignals:
    """Inside, each SIGTERM/SIGINT is appended to `signals`; with `second_interrupts`, a second one
    raises KeyboardInterrupt (a run's "stop now"). Off the main thread, signals are left alone."""

    def __init__(self, second_interrupts: bool = False) -> None:
        self.signals: list[int] = []
        self.second_interrupts = second_interrupts
        self._old: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return bool(self.signals)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signals and self.second_interrupts:
            raise KeyboardInterrupt
        self.signals.append(signum)

    def __enter__(self) -> "StopSignals":
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
