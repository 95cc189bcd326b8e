"""A run whose loss has diverged stops with one line instead of training on to its last step.

Two signs, each held for `reports` train reports in a row: the loss sits at ln(vocabulary size),
the loss of a model that gives every token the same probability (weights blown up by too high a
learning rate flatten it there, finite, so no step is ever non-finite); or the loss stays far
above the first report's (FAR_ABOVE). The first report of each invocation is the reference, so
a resumed run judges from where it resumed. Every rank sees the same reported loss (summed over
the ranks) and so stops at the same report.
"""

from __future__ import annotations

import math

AT_UNIFORM = 1e-3
"""How close to ln(vocabulary) counts as "at" it, relative: a random model starts near it but not this
near (the embedded model: 4.557 against ln 103 = 4.635); a blown-up one sits on it to 5 digits."""
FAR_ABOVE = 1.0
"""Nats above the first report (and at least half of it again) that count as far above it."""


class Diverged(Exception):
    """The loss diverged for `reports` reports in a row (exit training.NONFINITE_EXIT_CODE)."""

    def __init__(self, step: int, what: str, *, since: int, last_good: str = "") -> None:
        tail = f"; last good checkpoint: {last_good}" if last_good else ""
        super().__init__(f"step {step}: {what}{tail}")
        self.step, self.what, self.since = step, what, since  # since: the first diverged report's step


class DivergenceWatch:
    """Fed each train report's loss; raises Diverged once one sign has held `reports` times in a row (0: never)."""

    def __init__(self, *, vocab_size: int | None, reports: int) -> None:
        self.uniform = math.log(vocab_size) if vocab_size and vocab_size > 1 else None
        self.reports = reports
        self.first: float | None = None
        self.run, self.since = 0, 0

    def check(self, step: int, loss: float) -> None:
        if self.reports <= 0 or not math.isfinite(loss):
            return
        if self.first is None:
            self.first = loss
            return
        at_uniform = self.uniform is not None and abs(loss - self.uniform) <= AT_UNIFORM * self.uniform
        far_above = loss > self.first + max(FAR_ABOVE, self.first / 2)
        self.run = self.run + 1 if at_uniform or far_above else 0
        self.since = step if self.run == 1 else self.since
        if self.run < self.reports:
            return
        why = (f"the train loss has sat at {loss:.4f} = ln({math.exp(self.uniform):.0f}), the loss of predicting "
               "every token alike," if at_uniform else
               f"the train loss has stayed far above the first report's {self.first:.4f} (now {loss:.4f})")
        raise Diverged(step, f"{why} for {self.run} reports: training diverged; lower --learning-rate (or "
                             "raise --schedule.warmup), or give --train.divergence_reports 0 to train on regardless",
                       since=self.since)
