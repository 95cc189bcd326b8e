"""Optimizers and schedules as the config builds them."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import pytest

from meshtune.config import Config
from meshtune.training.optimizers import OPTIMIZERS, build_optimizer, build_schedule


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_takes_a_step(name):
    mx.random.seed(0)
    model = nn.Linear(8, 4)
    opt = build_optimizer(name=name, learning_rate=1e-2, weight_decay=None, options={})
    x, y = mx.random.normal((16, 8)), mx.random.normal((16, 4))
    loss_and_grad = nn.value_and_grad(model, lambda m: ((m(x) - y) ** 2).mean())
    before, _ = loss_and_grad(model)
    for _ in range(5):
        _, grads = loss_and_grad(model)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
    after, _ = loss_and_grad(model)
    assert after.item() < before.item()


def test_bad_optimizer_option_names_the_option():
    with pytest.raises(ValueError, match="optimizer.options"):
        build_optimizer(name="sgd", learning_rate=0.1, weight_decay=None, options={"betas": [0.9, 0.99]})


def test_warmup_then_cosine():
    cfg = Config.from_dict({"schedule": {"name": "cosine_decay", "warmup": 10}, "optimizer": {"learning_rate": 1e-3},
                            "train": {"iters": 110}})
    lr = build_schedule(name="cosine_decay", arguments=cfg.schedule_arguments(), warmup=10, warmup_init=0.0,
                        learning_rate=1e-3)
    at = lambda s: float(lr(mx.array(s)))  # noqa: E731
    assert at(0) == pytest.approx(0.0)
    assert at(5) == pytest.approx(5e-4)
    assert at(10) == pytest.approx(1e-3)
    assert at(11) == pytest.approx(1e-3, rel=1e-3)
    assert at(61) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 50 / 100)), rel=1e-3)
    assert at(110) == pytest.approx(0.0, abs=1e-6)


def test_constant_with_and_without_warmup():
    assert build_schedule(name="constant", arguments=[], warmup=0, warmup_init=0.0, learning_rate=2e-4) == 2e-4
    lr = build_schedule(name="constant", arguments=[], warmup=4, warmup_init=0.0, learning_rate=2e-4)
    assert float(lr(mx.array(2))) == pytest.approx(1e-4)
    assert float(lr(mx.array(8))) == pytest.approx(2e-4)


def test_schedule_needing_arguments_says_so():
    with pytest.raises(ValueError, match="schedule.arguments"):
        build_schedule(name="exponential_decay", arguments=None, warmup=0, warmup_init=0.0, learning_rate=1e-3)
