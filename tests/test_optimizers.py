"""Optimizers and schedules as the config builds them."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import pytest

from meshtune.optimizers import OPTIMIZERS, build_optimizer, build_schedule


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
    lr = build_schedule(name="cosine_decay", arguments=None, warmup=10, warmup_init=0.0,
                        learning_rate=1e-3, iters=110)
    at = lambda s: float(lr(mx.array(s)))  # noqa: E731
    assert at(0) == pytest.approx(0.0)
    assert at(5) == pytest.approx(5e-4)
    assert at(10) == pytest.approx(1e-3)
    assert at(11) == pytest.approx(1e-3, rel=1e-3)
    assert at(61) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 50 / 100)), rel=1e-3)
    assert at(110) == pytest.approx(0.0, abs=1e-6)


def test_constant_with_and_without_warmup():
    assert build_schedule(name="constant", arguments=None, warmup=0, warmup_init=0.0,
                          learning_rate=2e-4, iters=10) == 2e-4
    lr = build_schedule(name="constant", arguments=None, warmup=4, warmup_init=0.0, learning_rate=2e-4, iters=10)
    assert float(lr(mx.array(2))) == pytest.approx(1e-4)
    assert float(lr(mx.array(8))) == pytest.approx(2e-4)


def test_schedule_needing_arguments_says_so():
    with pytest.raises(ValueError, match="schedule.arguments"):
        build_schedule(name="exponential_decay", arguments=None, warmup=0, warmup_init=0.0,
                       learning_rate=1e-3, iters=10)


def _small_and_large_model():
    # One weight past PACK_MAX_ELEMENTS (updated on its own), the rest packed together.
    from meshtune.optimizers import PACK_MAX_ELEMENTS
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, PACK_MAX_ELEMENTS // 16 + 1))


@pytest.mark.parametrize("name,options", [("adam", {}), ("adamw", {"weight_decay": 0.1}),
                                          ("sgd", {"momentum": 0.9, "nesterov": True, "dampening": 0.0}),
                                          ("sgd", {})])
@pytest.mark.parametrize("compiled", [False, True])
def test_packed_updates_equal_the_plain_optimizer_bit_for_bit(name, options, compiled, monkeypatch):
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    import meshtune.optimizers as O

    packs = []
    real_pack = O._pack
    monkeypatch.setattr(O, "_pack", lambda arrays: packs.append(len(arrays)) or real_pack(arrays))
    results = []
    for packed in (True, False):
        mx.random.seed(0)
        model = _small_and_large_model()
        x, y = mx.random.normal((16, 8)), mx.random.normal((16, model.layers[-1].weight.shape[0]))
        opt = (build_optimizer(name=name, learning_rate=1e-2, weight_decay=None, options=options) if packed
               else O.OPTIMIZERS[name](learning_rate=1e-2, **options))
        assert isinstance(opt, O.PackedUpdates) == packed
        assert isinstance(opt, O.OPTIMIZERS[name]) and type(opt).__name__ == O.OPTIMIZERS[name].__name__
        loss_and_grad = nn.value_and_grad(model, lambda m: ((m(x) - y) ** 2).mean())

        def step():
            _, grads = loss_and_grad(model)
            opt.update(model, grads)

        if compiled:
            state = [model.state, opt.state]
            step = mx.compile(step, inputs=state, outputs=state)
        for _ in range(4):
            step()
            mx.eval(model.parameters(), opt.state)
        results.append((dict(tree_flatten(model.parameters())), dict(tree_flatten(opt.state))))
    (params, state), (ref_params, ref_state) = results
    # The five small arrays went through the packed update; the large weight did not.
    assert packs and set(packs) == {5}
    assert set(state) == set(ref_state)  # checkpoints hold the plain optimizer's per-parameter state
    for k in ref_params:
        assert mx.array_equal(params[k], ref_params[k]).item(), k
    for k in ref_state:
        assert mx.array_equal(state[k], ref_state[k]).item(), k
    assert not isinstance(optim.Adam(learning_rate=1e-2), O.PackedUpdates)


@pytest.mark.parametrize("name", ["adafactor", "muon"])
def test_optimizers_that_are_not_elementwise_are_not_packed(name):
    import meshtune.optimizers as O

    if name not in OPTIMIZERS:
        pytest.skip(f"{name} is not in this mlx")
    opt = build_optimizer(name=name, learning_rate=1e-2, weight_decay=None, options={})
    assert type(opt) is OPTIMIZERS[name] and not isinstance(opt, O.PackedUpdates)


def test_packed_updates_take_a_plain_optimizers_state():
    """A checkpoint's optimizer state (per parameter, as the plain optimizer keeps it) loads and continues."""
    from mlx.utils import tree_flatten

    import meshtune.optimizers as O

    runs = []
    for packed_second in (True, False):
        mx.random.seed(1)
        model = _small_and_large_model()
        x, y = mx.random.normal((16, 8)), mx.random.normal((16, model.layers[-1].weight.shape[0]))
        loss_and_grad = nn.value_and_grad(model, lambda m: ((m(x) - y) ** 2).mean())
        first = O.OPTIMIZERS["adam"](learning_rate=1e-2)
        for _ in range(2):
            first.update(model, loss_and_grad(model)[1])
            mx.eval(model.parameters(), first.state)
        second = (build_optimizer(name="adam", learning_rate=1e-2, weight_decay=None, options={}) if packed_second
                  else O.OPTIMIZERS["adam"](learning_rate=1e-2))
        second.state = first.state
        for _ in range(2):
            second.update(model, loss_and_grad(model)[1])
            mx.eval(model.parameters(), second.state)
        runs.append(dict(tree_flatten(model.parameters())))
    for k, v in runs[1].items():
        assert mx.array_equal(runs[0][k], v).item(), k
