"""Test hooks, not for users: make one step bad through the real step, two ways.

MESHTUNE_TEST_NONFINITE_STEP=N empties step N's batches of target tokens: the global batch of
that step has no tokens, so its gradient norm is 0/0 = nan through the real step and the
non-finite gate (training/update.py) must hold the update back. MESHTUNE_TEST_OVERFLOW_STEP=N
runs step N at an infinite learning rate: its gradient is finite, but the update it would make
is not, and the same gate must hold it back (tests/integration/test_nonfinite_steps.py,
`meshtune bench faults --case nonfinite_step` and `--case overflow_step`).
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import mlx.core as mx

from ..runtime.env import integer
from .strategy import Strategy

ENV = "MESHTUNE_TEST_NONFINITE_STEP"
OVERFLOW_ENV = "MESHTUNE_TEST_OVERFLOW_STEP"


class _FaultAtStep:
    """`strategy`, with a fault at its step number `at` (counted from `done` steps); all else passed through."""

    def __init__(self, strategy: Strategy, at: int, done: int) -> None:
        self._strategy, self._at, self._done = strategy, at, done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._strategy, name)


class _EmptiedStep(_FaultAtStep):
    """The faulty step sees batches without targets."""

    def step(self, batches: Iterator[Any]) -> Any:
        self._done += 1
        if self._done == self._at:
            batches = (b._replace(lengths=0 * b.lengths) for b in batches)
        return self._strategy.step(batches)


class _OverflowingStep(_FaultAtStep):
    """The faulty step runs at an infinite learning rate (a constant rate's optimizer state; the rate it
    had is put back after the step)."""

    def step(self, batches: Iterator[Any]) -> Any:
        self._done += 1
        if self._done != self._at:
            return self._strategy.step(batches)
        state = self._strategy.optimizer.state
        rate = state["learning_rate"]
        state["learning_rate"] = mx.full(rate.shape, float("inf"), dtype=rate.dtype)
        try:
            return self._strategy.step(batches)
        finally:
            state["learning_rate"] = rate


def with_forced_fault(strategy: Strategy, done: int) -> Strategy:
    """`strategy` as it is, or with a test hook's step made bad where its variable is set."""
    at = integer(ENV, os.environ.get(ENV, "0"), "a step number (a test hook: that step's batches keep no targets)")
    if at > 0:
        strategy = _EmptiedStep(strategy, at, done)
    at = integer(OVERFLOW_ENV, os.environ.get(OVERFLOW_ENV, "0"),
                 "a step number (a test hook: that step runs at an infinite learning rate)")
    return _OverflowingStep(strategy, at, done) if at > 0 else strategy
