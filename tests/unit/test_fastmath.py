"""The CPU fast SiLU: accuracy of exp, SiLU and its derivative; install and undo."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from meshtune.runtime.fastmath import fast_exp, fast_silu, install_fast_swiglu, swiglu, uninstall_fast_swiglu


def test_fast_exp_is_float32_accurate():
    x = mx.linspace(-80.0, 80.0, 100_001)
    rel = mx.abs(fast_exp(x) - mx.exp(x)) / mx.exp(x)
    assert rel.max().item() < 5e-7


def test_fast_exp_saturates_like_exp():
    x = mx.array([-200.0, -87.0, 0.0, 88.0])
    got = fast_exp(x)
    assert got[0].item() < 1e-37 and got[2].item() == 1.0 and got[3].item() > 1e37


def test_fast_silu_and_its_gradient_match_nn_silu():
    x = mx.random.normal((512, 96), key=mx.random.key(0)) * 6
    assert mx.allclose(fast_silu(x), nn.silu(x), rtol=1e-6, atol=1e-6)
    ours = mx.grad(lambda v: (fast_silu(v) * v).sum())(x)
    stock = mx.grad(lambda v: (nn.silu(v) * v).sum())(x)
    assert mx.allclose(ours, stock, rtol=1e-5, atol=1e-5)
    compiled = mx.compile(mx.grad(lambda v: (fast_silu(v) * v).sum()))(x)
    assert mx.allclose(compiled, stock, rtol=1e-5, atol=1e-5)


def test_other_dtypes_keep_stock_silu():
    g = mx.random.normal((4, 8), key=mx.random.key(1)).astype(mx.bfloat16)
    assert mx.array_equal(swiglu(g, g), nn.silu(g) * g)


def test_install_swaps_model_swiglu_and_training_matches(model_factory):
    import mlx_lm.models.llama as llama
    from mlx_lm.models import activations

    model = model_factory(layers=2, dim=32)
    tokens = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    loss = lambda m: nn.losses.cross_entropy(m(tokens[:, :-1]), tokens[:, 1:]).mean()  # noqa: E731
    want_loss, want_grads = nn.value_and_grad(model, loss)(model)
    try:
        assert install_fast_swiglu() >= 1
        assert llama.swiglu is swiglu and activations.swiglu is not swiglu
        got_loss, got_grads = nn.value_and_grad(model, loss)(model)
    finally:
        uninstall_fast_swiglu()
    assert llama.swiglu is activations.swiglu
    assert got_loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    from mlx.utils import tree_flatten

    for (k, a), (_, b) in zip(tree_flatten(got_grads), tree_flatten(want_grads)):
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-5), k
