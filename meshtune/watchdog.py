"""Turns a hung collective or a lost peer into a clean, named exit.

When a rank is killed, stopped or cut off, its peers block inside an all_sum or a
recv that never returns (MLX has no timeout there; mlx issue 4475 reports ring
deadlocks at 3+ ranks). A watchdog thread on every rank expects a heartbeat from the
training loop; after `timeout_s` without one it prints one line naming this rank and
the step it was stuck in and ends the process with EXIT_CODE, so a launcher sees a
failure instead of waiting forever.
"""

from __future__ import annotations

import os
import sys
import threading
import time

EXIT_CODE = 75  # EX_TEMPFAIL: the run can be resumed from its last checkpoint


class Watchdog:
    """`beat(step)` from the loop; exits the process when beats stop for `timeout_s`."""

    def __init__(self, timeout_s: float, rank: int, world_size: int) -> None:
        self.timeout_s, self.rank, self.world_size = timeout_s, rank, world_size
        self._step, self._last = 0, time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Watchdog":
        if self.timeout_s > 0 and self.world_size > 1:
            self._thread = threading.Thread(target=self._watch, name="meshtune-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def beat(self, step: int) -> None:
        """A finished step."""
        self._step, self._last = step, time.monotonic()

    def alive(self) -> None:
        """Progress inside a step (an eval batch): the step number stays."""
        self._last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                print(f"meshtune: rank {self.rank}: no progress for {idle:.0f}s at step {self._step}: a peer "
                      f"rank stopped answering (killed, stopped or cut off); exiting with {EXIT_CODE}. "
                      "Resume with --resume from the last checkpoint.", file=sys.stderr, flush=True)
                os._exit(EXIT_CODE)
