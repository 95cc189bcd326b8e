"""training/divergence.py: a loss at ln(vocabulary) or far above its start for several reports stops the run."""

from __future__ import annotations

import math

import pytest

from meshtune.training.divergence import Diverged, DivergenceWatch


def feed(watch: DivergenceWatch, losses: list[float]) -> None:
    for i, loss in enumerate(losses, 1):
        watch.check(10 * i, loss)


def test_a_loss_sitting_at_ln_vocab_stops_after_the_set_reports():
    uniform = math.log(103)
    watch = DivergenceWatch(vocab_size=103, reports=3)
    with pytest.raises(Diverged) as stopped:
        feed(watch, [4.55, 4.9, uniform, uniform + 1e-4, uniform])
    assert stopped.value.step == 50 and stopped.value.since == 30
    line = str(stopped.value)
    assert "= ln(103), the loss of predicting every token alike, for 3 reports" in line
    assert "--train.divergence_reports 0" in line and "\n" not in line


def test_a_loss_far_above_its_start_stops_and_a_recovery_resets_the_count():
    watch = DivergenceWatch(vocab_size=50000, reports=3)
    feed(watch, [2.0, 3.5, 3.6, 1.9, 3.5, 3.5])  # two bad, one good (reset), two bad: not yet
    with pytest.raises(Diverged, match="far above the first report's 2.0000 \\(now 3.5000\\) for 3 reports"):
        watch.check(70, 3.5)


@pytest.mark.parametrize("losses", [
    [4.557, 4.556, 4.555, 4.554, 4.553, 4.552],  # a random model learning slowly, just under ln(103)
    [2.0, 2.9, 2.9, 2.9, 2.9, 2.9],  # up, but not far
    [2.0, float("nan"), float("inf"), 1.8, 1.7, 1.6],  # non-finite reports are the update gate's business
])
def test_slow_or_noisy_training_is_not_called_diverged(losses):
    feed(DivergenceWatch(vocab_size=103, reports=3), losses)


def test_zero_reports_never_stops():
    feed(DivergenceWatch(vocab_size=103, reports=0), [2.0] + [math.log(103)] * 20)
