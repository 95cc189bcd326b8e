"""Layer properties of LoRA and DoRA on all six base types, and the quantized base path.

Tolerances: float32 throughout; unfused vs fused or vs a dense reference agree to
1e-4 absolute (outputs are O(1), the two sides sum in different orders); the DoRA
row norm from the identity agrees with the dense norm to 1e-5 relative.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from meshtune.adapters import (BasePath, DoRAEmbedding, DoRALinear, DoRASwitchLinear, LoRAEmbedding, LoRALinear,
                               LoRASwitchLinear, measure_crossover)
from meshtune.adapters import base_path

KINDS = ["linear", "qlinear", "embedding", "qembedding", "switch", "qswitch"]
VARIANTS = ["lora", "dora"]
E, IN, OUT, N, R, S = 4, 64, 48, 40, 4, 2.0
ATOL = 1e-4


def _base(kind):
    mx.random.seed(1)
    if "linear" in kind:
        layer = nn.Linear(IN, OUT, bias=True)
        layer.bias = mx.random.normal(layer.bias.shape)
    elif "embedding" in kind:
        layer = nn.Embedding(N, IN)
    else:
        layer = SwitchLinear(IN, OUT, E, bias=True)
        layer.bias = mx.random.normal(layer.bias.shape)
    mx.eval(layer.parameters())
    if kind == "qlinear":
        return nn.QuantizedLinear.from_linear(layer, group_size=32, bits=4)
    if kind == "qembedding":
        return nn.QuantizedEmbedding.from_embedding(layer, group_size=32, bits=4)
    if kind == "qswitch":
        return layer.to_quantized(group_size=32, bits=4)
    return layer


def _wrap(kind, variant, base, path="auto"):
    family = {"linear": (LoRALinear, DoRALinear), "embedding": (LoRAEmbedding, DoRAEmbedding),
              "switch": (LoRASwitchLinear, DoRASwitchLinear)}[kind.lstrip("q")]
    return family[variant == "dora"].from_base(base, r=R, scale=S, base_path=BasePath(path))


def _input(kind, sorted_experts=False):
    mx.random.seed(2)
    if "linear" in kind:
        return (mx.random.normal((3, 5, IN)),)
    if "embedding" in kind:
        return (mx.array([[1, 5, 39, 0], [2, 2, 7, 11]]),)
    if sorted_experts:  # SwitchGLU's layout for many tokens: flat, sorted by expert
        return mx.random.normal((9, 1, IN)), mx.sort(mx.random.randint(0, E, (9,)).astype(mx.uint32)), True
    return mx.random.normal((2, 5, 1, 1, IN)), mx.random.randint(0, E, (2, 5, 2)).astype(mx.uint32)


def _randomize(layer):
    layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.1
    if "m" in layer:
        layer.m = layer.m * (1 + 0.2 * mx.random.uniform(shape=layer.m.shape))


def _dense(base):
    if isinstance(base, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)):
        return mx.dequantize(base.weight, base.scales, base.biases, group_size=base.group_size, bits=base.bits)
    return base.weight


def _reference_weight(kind, layer):
    """W + s dW, normalised per row and scaled by m for DoRA: dense, float32, from the paper."""
    a, b = layer.lora_a, layer.lora_b
    base = layer.embedding if "embedding" in kind else layer.linear
    delta = {"linear": lambda: b.T @ a.T, "embedding": lambda: a @ b, "switch": lambda: b @ a}[kind.lstrip("q")]()
    w = _dense(base) + S * delta
    if "m" in layer:
        w = layer.m[..., None] * w / mx.linalg.norm(w, axis=-1, keepdims=True)
    return w


def _reference_out(kind, layer, inputs):
    w = _reference_weight(kind, layer)
    if "embedding" in kind:
        return w[inputs[0]]
    if "qlinear" == kind or "linear" == kind:
        return inputs[0] @ w.T + layer.linear.bias
    x, idx = inputs[:2]
    y = (w[idx] @ x.swapaxes(-1, -2)).swapaxes(-1, -2)
    return y + mx.expand_dims(layer.linear.bias[idx], -2)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", KINDS)
def test_output_unchanged_at_step0(kind, variant):
    base = _base(kind)
    inputs = _input(kind)
    # The base's own kernel, so LoRA must match it bit for bit.
    want, got = base(*inputs), _wrap(kind, variant, base, "quantized")(*inputs)
    if variant == "lora":
        assert mx.array_equal(got, want)
    else:  # m / ||W|| is exactly 1; only where the bias is added can rounding differ
        assert mx.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("path", ["quantized", "dequantized"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", KINDS)
def test_forward_equals_dense_reference(kind, variant, path):
    layer = _wrap(kind, variant, _base(kind), path)
    _randomize(layer)
    for inputs in [_input(kind)] + ([_input(kind, sorted_experts=True)] if "switch" in kind else []):
        assert mx.allclose(layer(*inputs), _reference_out(kind, layer, inputs), atol=ATOL)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", KINDS)
def test_fused_equals_unfused(kind, variant):
    base = _base(kind)
    layer = _wrap(kind, variant, base)
    _randomize(layer)
    inputs = _input(kind)
    fused = layer.fuse(dequantize=True)
    assert type(fused) is {"linear": nn.Linear, "embedding": nn.Embedding, "switch": SwitchLinear}[kind.lstrip("q")]
    assert mx.allclose(fused(*inputs), layer(*inputs), atol=ATOL)
    if kind.startswith("q"):
        requant = layer.fuse()
        assert type(requant) is type(base)
        assert (requant.bits, requant.group_size, requant.mode) == (base.bits, base.group_size, base.mode)
        # 4-bit requantization costs precision: the error stays at the quantization step's scale.
        assert mx.abs(requant(*inputs) - layer(*inputs)).max().item() < 0.25


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", KINDS)
def test_trainable_count_formula(kind, variant):
    layer = _wrap(kind, variant, _base(kind))
    layer.freeze()
    layer.unfreeze(keys=["lora_a", "lora_b", "m"], recurse=False, strict=False)
    names = {k for k, _ in tree_flatten(layer.trainable_parameters())}
    n = sum(v.size for _, v in tree_flatten(layer.trainable_parameters()))
    rows, cols, experts = {"linear": (OUT, IN, 1), "embedding": (N, IN, 1), "switch": (OUT, IN, E)}[kind.lstrip("q")]
    # r (rows + cols) per expert, plus one magnitude per row for DoRA; the cached ||w_i||^2 is not a parameter.
    assert n == experts * (R * (rows + cols) + (rows if variant == "dora" else 0))
    assert names == ({"lora_a", "lora_b", "m"} if variant == "dora" else {"lora_a", "lora_b"})
    assert "_w_sq" not in dict(tree_flatten(layer.parameters()))


@pytest.mark.parametrize("kind", KINDS)
def test_norm_identity_equals_dense_norm(kind):
    layer = _wrap(kind, "dora", _base(kind))
    layer.lora_b = mx.random.normal(layer.lora_b.shape)  # a large update: the cross terms matter
    base = layer.embedding if "embedding" in kind else layer.linear
    a, b = layer.lora_a, layer.lora_b
    delta = {"linear": lambda: b.T @ a.T, "embedding": lambda: a @ b, "switch": lambda: b @ a}[kind.lstrip("q")]()
    dense = mx.linalg.norm(_dense(base) + S * delta, axis=-1)
    assert layer.row_norm().shape == layer.m.shape == dense.shape
    assert mx.allclose(layer.row_norm(), dense, rtol=1e-5, atol=0)


@pytest.mark.parametrize("kind", ["embedding", "qembedding"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_tied_head_consistent_with_adapted_table(kind, variant):
    layer = _wrap(kind, variant, _base(kind))
    _randomize(layer)
    table = layer.fuse(dequantize=True).weight
    h = mx.random.normal((2, IN))
    assert mx.allclose(layer.as_linear(h), h @ table.T, atol=ATOL)
    tokens = mx.array([0, 3, 39])
    assert mx.allclose(layer(tokens), table[tokens], atol=ATOL)


@pytest.mark.parametrize("kind", ["linear", "qlinear"])
def test_norm_is_stop_gradient(kind):
    """Section 4.3: d out / d m = v / ||W'||, and no gradient flows through the norm."""
    layer = _wrap(kind, "dora", _base(kind))
    _randomize(layer)
    x = mx.random.normal((6, IN))
    g = mx.random.normal((6, OUT))
    w = _dense(layer.linear) + S * (layer.lora_b.T @ layer.lora_a.T)
    norm = mx.linalg.norm(w, axis=-1)
    v = x @ w.T

    def loss(params):
        layer.update(params)
        return (layer(x) * g).sum()

    grads = mx.grad(loss)(layer.trainable_parameters())
    assert mx.allclose(grads["m"], (g * v).sum(0) / norm, rtol=1e-4, atol=1e-5)

    def reference(b, detach):
        w = _dense(layer.linear) + S * (b.T @ layer.lora_a.T)
        n = norm if detach else mx.linalg.norm(w, axis=-1)
        return ((x @ (layer.m[:, None] * w / n[:, None]).T) * g).sum()

    detached = mx.grad(lambda b: reference(b, True))(layer.lora_b)
    assert mx.allclose(grads["lora_b"], detached, rtol=1e-4, atol=1e-5)
    # The test has teeth: letting the norm take part changes lora_b's gradient.
    assert not mx.allclose(grads["lora_b"], mx.grad(lambda b: reference(b, False))(layer.lora_b), atol=1e-5)


def test_stock_dora_layers_give_our_outputs():
    from mlx_lm.tuner.dora import DoRAEmbedding as StockEmbedding, DoRALinear as StockLinear

    for kind, stock_cls in [("linear", StockLinear), ("qlinear", StockLinear), ("embedding", StockEmbedding)]:
        ours = _wrap(kind, "dora", _base(kind))
        _randomize(ours)
        stock = stock_cls.from_base(_base(kind), r=R, scale=S)
        stock.update(ours.trainable_parameters())
        inputs = _input(kind)
        assert mx.allclose(stock(*inputs), ours(*inputs), atol=1e-5), kind
        if "embedding" in kind:
            h = mx.random.normal((3, IN))
            assert mx.allclose(stock.as_linear(h), ours.as_linear(h), atol=1e-5)


@pytest.mark.parametrize("kind", ["qlinear", "qembedding", "qswitch"])
def test_base_paths_agree(kind):
    layer = _base(kind)
    if kind == "qswitch":
        x, idx = _input(kind)
        run = lambda path: BasePath(path).switch_forward(layer, x, idx)
    else:
        x = mx.random.normal((7, IN))
        run = lambda path: BasePath(path).linear_forward(layer, x)
    assert mx.allclose(run("dequantized"), run("quantized"), atol=1e-4)


def test_auto_chooses_by_measured_token_count():
    layer = _base("qlinear")
    calls = []
    auto = BasePath(measure=lambda *a, **k: calls.append(k) or 16)
    assert BasePath().mode == "auto"
    assert not auto.use_dequantized(layer, 15)
    assert auto.use_dequantized(layer, 16)
    assert len(calls) == 1 and calls[0]["bits"] == 4 and calls[0]["group_size"] == 32  # measured once
    assert not BasePath("quantized").use_dequantized(layer, 10_000)
    assert BasePath("dequantized").use_dequantized(layer, 1)
    assert auto.use_dequantized(layer, 16) and not auto.use_dequantized(layer, 15)  # each path its own threshold
    assert not auto.use_dequantized(nn.Linear(4, 4), 10_000)  # dense bases have one path


def test_a_run_s_kept_crossovers_are_taken_instead_of_measured():
    """What a run keeps in base_path.json (measured()) a resumed run adopts: the same paths, no measurement."""
    import json

    layer = _base("qlinear")
    run = BasePath(measure=lambda *a, **k: 16)
    run.crossover_for(layer)
    kept = json.loads(json.dumps(run.measured()))
    assert list(kept.values()) == [16]
    resumed = BasePath(measure=lambda *a, **k: pytest.fail("measured again"))
    assert resumed.adopt(kept) == 1
    assert resumed.crossover_for(layer) == 16 and resumed.measured() == kept


def test_measure_crossover_returns_a_measured_count():
    counts = (1, 8, 64, 512)
    for experts in (0, E):
        got = measure_crossover(OUT, IN, bits=4, group_size=32, num_experts=experts, token_counts=counts)
        assert got in counts or got == base_path.NEVER


def test_crossover_timing_runs_fast_calls_in_batches_and_picks_the_faster():
    small, large = mx.ones((64, 64)), mx.ones((512, 512))
    calls = []
    cheap = lambda: calls.append(1) or small + 1
    mx.eval(small, large)
    assert base_path._runs(cheap)  # as measure_crossover does: the first call made before any timing
    # One add is far below MIN_TIMED_SECONDS; the best of three, as a 2-core CI machine can preempt one call for 2 ms.
    assert max(base_path._calls_a_timing(cheap) for _ in range(3)) > 1
    assert base_path._calls_a_timing(lambda: large @ large @ large @ large) >= 1
    slow = lambda: large @ large @ large @ large
    assert base_path._dense_is_faster(cheap, slow, repeats=2)
    assert not base_path._dense_is_faster(slow, cheap, repeats=2)

    def missing():
        raise RuntimeError("no kernel for this dtype")
    assert not base_path._dense_is_faster(missing, slow, repeats=2)  # the path that runs wins
    assert base_path._dense_is_faster(slow, missing, repeats=2)


def test_bad_base_path_names_the_choices():
    with pytest.raises(ValueError, match="auto, quantized, dequantized"):
        BasePath("fast")
