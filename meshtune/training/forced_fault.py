"""A test hook, not for users: MESHTUNE_TEST_NONFINITE_STEP=N empties step N's batches of target tokens.

The global batch of that step then has no tokens, so its gradient norm is 0/0 = nan through the real
step and the non-finite gate (training/update.py), which must hold the update back
(tests/integration/test_nonfinite_steps.py, `meshtune bench faults --case nonfinite_step`).
"""

from __future__ import annotations

import os
from typing import Any, Iterator

from ..runtime.env import integer
from .strategy import Strategy

ENV = "MESHTUNE_TEST_NONFINITE_STEP"


class _EmptiedStep:
    """`strategy`, whose step number `at` (counted from `done` steps) sees batches without targets."""

    def __init__(self, strategy: Strategy, at: int, done: int) -> None:
        self._strategy, self._at, self._done = strategy, at, done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._strategy, name)

    def step(self, batches: Iterator[Any]) -> Any:
        self._done += 1
        if self._done == self._at:
            batches = (b._replace(lengths=0 * b.lengths) for b in batches)
        return self._strategy.step(batches)


def with_forced_fault(strategy: Strategy, done: int) -> Strategy:
    """`strategy` as it is, or with the test hook's step emptied where the variable is set."""
    at = integer(ENV, os.environ.get(ENV, "0"), "a step number (a test hook: that step's batches keep no targets)")
    return _EmptiedStep(strategy, at, done) if at > 0 else strategy
