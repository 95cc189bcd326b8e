"""DoRA's kernels in a training step (adapters/step_norms.py's launches, the layers' folded, merged and unfolded
products, meshtune's step), every kernel run by the CPU simulator (cuda_sim.py): launches counted by name, losses
and gradients against the layer-by-layer path and dense references. Each test builds the step's StepRowNorms (or
the run's StepContext) with the fold it needs."""

import os
from collections import Counter

import mlx.core as mx
import pytest

from cuda_sim import FOLDED_GRAD, FOLDED_SUMS, calls as _calls


def _dora_step_graph_products(layer, x, norms) -> Counter:
    """The matrix products (Matmul, AddMM) of a DoRA layer's training forward and its input's gradient as one
    step takes them (`norms`, a StepRowNorms), counted in their graph."""
    import re
    import tempfile

    with norms(layer, x.size // x.shape[-1]):
        (y,), (dx,) = mx.vjp(layer, [x], [mx.ones(x.shape[:-1] + (layer.m.size,))])
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.dot")
        mx.export_to_dot(path, y, dx)
        names = re.findall(r'label\s*=\s*"([A-Za-z]+)', open(path).read())
    return Counter(n for n in names if n in ("Matmul", "AddMM"))


@pytest.mark.parametrize("quantized", [False, True])
def test_merged_fold_layer_matches_the_dense_reference(simulated, quantized):
    """A folded training step merges: a DoRA layer without dropout runs one product on the launch's
    merged W' = rs (W + s (A B)^T); its output and its gradients (x, A, B, m) are autodiff's of the dense
    reference m / ||W + s (A B)^T||_row (W + s (A B)^T) x, and its graph has fewer products than the unmerged
    fold's (LoRA's branch on W' = rs W)."""
    import mlx.nn as nn

    from meshtune.adapters import BasePath, DoRALinear
    from meshtune.adapters.base_path import dequantized_weight
    from meshtune.adapters.step_norms import StepRowNorms, taken

    norms = StepRowNorms(fold=True)
    k = mx.random.split(mx.random.key(11), 4)
    base = nn.Linear(64, 24, bias=False)
    if quantized:
        base = nn.QuantizedLinear.from_linear(base, group_size=32, bits=4)
    layer = DoRALinear.from_base(base, r=4, scale=2.0, base_path=BasePath("dequantized"))
    layer.lora_b = mx.random.normal(layer.lora_b.shape, key=k[0]) / 4
    layer.m = layer.m * mx.random.uniform(0.5, 1.5, layer.m.shape, key=k[1])
    layer.train()
    x = mx.random.normal((2, 5, 64), key=k[2])
    probe = mx.random.normal((2, 5, 24), key=k[3])
    w = dequantized_weight(base).astype(mx.float32)

    def ours(x, a, b, m):
        layer.lora_a, layer.lora_b, layer.m = a, b, m
        with norms(layer, 10):
            assert taken(layer, 10).merged
            return (layer(x) * probe).sum()

    def reference(x, a, b, m):
        dense = w + 2.0 * (a @ b).T
        norm = mx.stop_gradient(mx.sqrt((dense * dense).sum(-1)))
        return ((m / norm) * (x @ dense.T) * probe).sum()

    args = (x, layer.lora_a, layer.lora_b, layer.m)
    got_v, got = mx.value_and_grad(ours, argnums=(0, 1, 2, 3))(*args)
    want_v, want = mx.value_and_grad(reference, argnums=(0, 1, 2, 3))(*args)
    assert abs(got_v.item() - want_v.item()) <= 1e-4 * abs(want_v.item())
    for name, g, h in zip("x a b m".split(), got, want):
        assert mx.allclose(g, h, rtol=1e-4, atol=1e-5).item(), name
    assert _calls(simulated, _step_norm_kernel(True, 1, quantized=quantized, merged=True)) >= 1
    layer.lora_a, layer.lora_b, layer.m = args[1:]
    merged = _dora_step_graph_products(layer, x, norms)
    layer.dropout_rate = 0.5  # claimed only (its Dropout stays p=0): the step folds unmerged
    unmerged = _dora_step_graph_products(layer, x, norms)
    assert sum(merged.values()) <= sum(unmerged.values()) - 3, (merged, unmerged)


def test_a_dora_layer_with_dropout_is_not_merged(simulated):
    """Dropout gives LoRA's branch another input than the base's, so that layer's W' stays rs W (the launch of
    its own shape unmerged, not the merged one)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from meshtune.adapters import DoRALinear
    from meshtune.adapters.step_norms import StepRowNorms, taken

    norms = StepRowNorms(fold=True)
    layer = DoRALinear.from_base(nn.Linear(64, 24, bias=False), r=4, dropout=0.25, scale=2.0)
    layer.lora_b = mx.random.normal(layer.lora_b.shape, key=mx.random.key(1)) / 4
    layer.train()
    x = mx.random.normal((2, 5, 64), key=mx.random.key(2))
    loss_and_grad = nn.value_and_grad(layer, lambda x: layer(x).sum())

    def step():
        mx.random.seed(5)  # the same dropout mask both times
        with norms(layer, 10):
            assert not taken(layer, 10).merged
            value, grads = loss_and_grad(x)
            mx.eval(value, grads)
        return value, grads

    value, grads = step()
    assert _calls(simulated, _step_norm_kernel(True, 1, merged=False)) == 1
    assert _step_norm_kernel(True, 1, merged=True) not in simulated
    assert all(mx.isfinite(g).all().item() for _, g in tree_flatten(grads)) and mx.isfinite(value).item()


def _step_norm_kernel(fold: bool, layers: int, quantized: bool = False, merged: bool | None = None) -> str:
    """The name of the norm kernel a training step launches for `layers` layers of one shape: folded (writing W',
    rs, A and B'), reading a quantized base packed, writing the merged W' where `merged` (default: folded, as
    for layers without dropout)."""
    from meshtune.adapters import kernels

    return kernels.row_norm_kernel_name(layers, fold, packed=fold and quantized, merged=fold if merged is None else merged)


def _dora_layers(quantize: bool):
    """DoRA layers of three shapes (two share one), one on a 4-bit base, with nonzero B; the 4-bit base takes
    the dense path, as at training sizes."""
    import mlx.nn as nn

    from meshtune.adapters import BasePath, DoRALinear

    mx.random.seed(3)
    bases = [nn.Linear(64, out, bias=False) for out in (16, 16, 24, 32)]
    if quantize:
        bases[3] = nn.QuantizedLinear.from_linear(bases[3], group_size=32, bits=4)
    paths = BasePath("dequantized")
    layers = [DoRALinear.from_base(base, r=4, scale=s, base_path=paths)
              for base, s in zip(bases, (2.0, 0.5, 2.0, 1.0))]
    for layer in layers:
        layer.lora_b = mx.random.normal(layer.lora_b.shape) / 4
    mx.eval([layer.parameters() for layer in layers])
    return layers


def _fan(layers):
    """A module that sums its layers' outputs on one input, each weighted by its place."""
    import mlx.nn as nn

    class Fan(nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.layers = layers

        def __call__(self, x):
            return sum((layer(x) * (i + 1)).sum() for i, layer in enumerate(self.layers))

    return Fan(layers)


@pytest.mark.parametrize("fold", [True, False])
def test_step_row_norms_take_every_layer_at_once(simulated, fold):
    """Under StepRowNorms a training step launches one norm kernel per shape of layer, not
    one per layer, and gets the loss and gradients it gets layer by layer; folded (the
    default, W' = rs W written by the same launch) or not."""
    import mlx.nn as nn

    from meshtune.adapters.step_norms import StepRowNorms, taken

    model = _fan(_dora_layers(quantize=True))
    model.train()
    x = mx.random.normal((2, 5, 64), key=mx.random.key(4))
    loss_and_grad = nn.value_and_grad(model, lambda x: model(x))
    want_v, want = loss_and_grad(x)
    mx.eval(want_v, want)
    assert simulated["meshtune_dora_row_norm_1"].calls == 4  # a launch a layer
    with StepRowNorms(fold=fold)(model, 10):
        assert taken(model.layers[0], 10) is not None and taken(model.layers[0], 11) is None
        got_v, got = loss_and_grad(x)
        mx.eval(got_v, got)
    assert taken(model.layers[0], 10) is None  # nothing left behind
    assert simulated[_step_norm_kernel(fold, layers=2)].calls == 1  # the two 16-row layers together
    # The 24-row layer and the 4-bit 32-row one: folded, the 4-bit weight is read packed by a launch of its
    # own (no dequantized copy); unfolded it is dequantized, then the same kernel as a dense base's.
    assert simulated[_step_norm_kernel(fold, layers=1)].calls == (1 if fold else 4 + 2)
    if fold:
        assert simulated[_step_norm_kernel(fold, layers=1, quantized=True)].calls == 1
        assert simulated["meshtune_dora_row_norm_1"].calls == 4  # none unfolded in the step
        # m's and B's gradients from the sums a layer, each reading its norms in its launch's array.
        assert simulated[FOLDED_GRAD].calls == 4
    # Folded, W' = rs W is rounded once per element (the sum of the fan's outputs cancels: ~1e-5 of it).
    assert mx.allclose(got_v, want_v, rtol=1e-4 if fold else 1e-6).item()
    from mlx.utils import tree_flatten
    for (name, g), (_, h) in zip(tree_flatten(got), tree_flatten(want)):
        assert mx.allclose(g, h, rtol=1e-5, atol=1e-6).item(), name


@pytest.mark.parametrize("memory, setting, dense_folded", [(None, "auto", True), (1 << 40, "auto", True),
                                                          (1000, "auto", False), (1000, True, True)])
def test_auto_fold_leaves_dense_bases_unfolded_where_copies_would_not_fit(simulated, capsys, memory, setting,
                                                                           dense_folded):
    """StepRowNorms.fold "auto" (the default): a dense base's W' is a second copy held through the
    step, so those are folded only while the copies take at most FOLD_MEMORY_SHARE of the GPU's memory
    (folded where the GPU does not report it); a quantized base is folded either way (W' replaces its
    dequantized copy). Declining says so once on stderr, naming the setting that forces it."""
    import mlx.nn as nn

    from meshtune.adapters.step_norms import StepRowNorms, taken

    norms = StepRowNorms(fold=setting, memory=memory)
    model = _fan(_dora_layers(quantize=True))
    model.train()
    x = mx.random.normal((2, 5, 64), key=mx.random.key(4))
    loss_and_grad = nn.value_and_grad(model, lambda x: model(x))
    for _ in range(2):
        with norms(model, 10):
            assert (taken(model.layers[0], 10).scaled_weight is not None) == dense_folded  # a dense base
            assert taken(model.layers[3], 10).scaled_weight is not None  # the 4-bit base
            mx.eval(loss_and_grad(x))
    err = capsys.readouterr().err
    if dense_folded:
        assert "folded step is off" not in err
    else:
        assert err.count("folded step is off for dense bases") == 1 and "adapter.dora_fold: true" in err


@pytest.mark.parametrize("fold", [True, False])
def test_training_step_takes_dora_norms_before_the_forward(simulated, model_factory, fold):
    """meshtune's step (parallel.data_parallel_step.build_step) on a model with DoRA: one norm launch per shape; folded
    (the default) m's gradient by the sums-only kernel, else by the cotangent kernel."""
    import mlx.optimizers as optim

    from meshtune.adapters import StepContext, apply_adapters
    from meshtune.runtime.mesh import Mesh
    from meshtune.parallel.data_parallel_step import build_step

    model = model_factory(layers=2, dim=32)
    apply_adapters(model, fine_tune_type="dora", num_layers=2, keys=["self_attn.q_proj", "self_attn.v_proj"],
                   rank=4, scale=2.0, dropout=0.0)
    model.train()
    step = build_step(model, optim.SGD(learning_rate=0.1), Mesh.single(), max_grad_norm=0.0, compile=False,
                      step_context=StepContext.for_run(dora_fold=fold))
    tokens = mx.random.randint(0, 64, (2, 9), key=mx.random.key(1))
    lengths = mx.array([[0, 9], [0, 9]])
    ce, n, _ = step.finish(tokens, lengths, None, None)
    mx.eval(ce, n, model.parameters())
    # q (32 rows) in both blocks in one launch, v (16 rows: 2 kv heads) in both in another.
    assert {k: v.calls for k, v in simulated.items() if "row_norm" in k} == {_step_norm_kernel(fold, layers=2): 2}
    assert simulated[FOLDED_SUMS if fold else "meshtune_dora_cotangent"].calls == 4
    assert ("meshtune_dora_cotangent" if fold else FOLDED_SUMS) not in simulated


def _two_dora_sgd_steps(model_factory, *, quantized: bool, norms, built=None, paths=None):
    """Two steps of meshtune's step (parallel.data_parallel_step.build_step, uncompiled, SGD: the update is the gradient,
    which Adam's per-element normalisation would blow up at ~0) on a 2-block model, 4-bit where
    `quantized`, with DoRA on q_proj and down_proj and non-zero B (the row scale moves off 1), DoRA's per-step work
    `norms` (a StepRowNorms): (the two losses, the trainable parameters after). `built(model)` runs before the
    steps. A quantized base takes the dense path at 16 tokens too (`paths`, default BasePath("dequantized"))."""
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    from meshtune.adapters import BasePath, StepContext, apply_adapters
    from meshtune.runtime.mesh import Mesh
    from meshtune.parallel.data_parallel_step import build_step

    model = model_factory(layers=2, dim=64)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    apply_adapters(model, fine_tune_type="dora", num_layers=2, keys=["self_attn.q_proj", "mlp.down_proj"],
                   rank=4, scale=2.0, dropout=0.0, base_path=paths or BasePath("dequantized"))
    for _, layer in model.named_modules():
        if hasattr(layer, "lora_b"):
            layer.lora_b = mx.random.normal(layer.lora_b.shape, key=mx.random.key(2)) * 0.05
    model.train()
    if built is not None:
        built(model)
    step = build_step(model, optim.SGD(learning_rate=0.1), Mesh.single(), max_grad_norm=0.0, compile=False,
                      step_context=StepContext(norms))
    tokens = mx.random.randint(0, 64, (2, 9), key=mx.random.key(1))
    lengths = mx.array([[0, 9], [0, 9]])
    losses = []
    for _ in range(2):
        ce, n, _ = step.finish(tokens, lengths, None, None)
        mx.eval(ce, n, model.parameters())
        losses.append((ce / n).item())
    return losses, dict(tree_flatten(model.trainable_parameters()))


@pytest.mark.parametrize("quantized", [False, True])
def test_folded_training_step_trains_as_the_current_one(simulated, model_factory, quantized):
    """StepRowNorms.fold: the step writes W' = rs W beside the norms and every DoRA layer runs
    LoRA's product on W' and B' = B rs, m's gradient by the sums-only kernel; the loss and the
    parameters after two steps are the current step's, on a dense and on a quantized base (SGD:
    the update is the gradient, which Adam's per-element normalisation would blow up at ~0). B's product
    summed with m's sums."""
    from meshtune.adapters import BasePath
    from meshtune.adapters.base_path import is_quantized
    from meshtune.adapters.step_norms import StepRowNorms

    class Dequantizing(BasePath):
        """The run's base path ("dequantized"), keeping each quantized base it hands a dense weight of."""

        def __init__(self):
            super().__init__("dequantized")
            self.bases = []

        def dense_weight_for(self, layer, tokens):
            if is_quantized(layer):
                self.bases.append(layer)
            return super().dense_weight_for(layer, tokens)

    dora_bases = []

    def trained(fold):
        paths = Dequantizing()
        built = lambda model: dora_bases.extend(l.linear for _, l in model.named_modules() if hasattr(l, "lora_b"))
        return _two_dora_sgd_steps(model_factory, quantized=quantized, norms=StepRowNorms(fold=fold), built=built,
                                   paths=paths), paths.bases

    (base_losses, base), unfolded_dequantized = trained(False)
    assert _step_norm_kernel(fold=True, layers=2, quantized=quantized) not in simulated
    (losses, folded), dequantized = trained(True)
    assert _calls(simulated, _step_norm_kernel(fold=True, layers=2, quantized=quantized)) >= 1
    assert simulated[FOLDED_SUMS].calls == 8
    # A 4-bit DoRA base is read packed by the step's launch, which writes W': it is never dequantized (unfolded,
    # each step dequantizes it once, in step_norms, for the norm kernel and the layer's products).
    assert not any(base is layer for base in dora_bases for layer in dequantized)
    assert any(base is layer for base in dora_bases for layer in unfolded_dequantized) == quantized
    assert losses == pytest.approx(base_losses, rel=1e-5)
    for key, value in base.items():
        assert mx.allclose(folded[key], value, rtol=1e-5, atol=1e-6).item(), key


@pytest.mark.parametrize("quantized", [False, True])
def test_factors_from_the_norm_kernel_train_as_the_layers_casts(simulated, model_factory, quantized):
    """The folded step's norm launches write every DoRA layer's A and B' = B rs, and the step hands them to the
    layers in place of their own casts; two steps give the same losses and parameters as the layers' casts (the
    step handing them no factors), to the bit."""
    from meshtune.adapters import kernels
    from meshtune.adapters.step_norms import StepRowNorms, taken

    def unmerged(model):  # the factors against the casts in LoRA's branch too; merged: its own test
        for _, layer in model.named_modules():
            if hasattr(layer, "lora_b"):
                layer.dropout_rate = 0.5  # claimed only (its Dropout stays p=0): the step folds unmerged

    no_factors = StepRowNorms(fold=True, hand_factors=False)
    want_losses, want = _two_dora_sgd_steps(model_factory, quantized=quantized, norms=no_factors, built=unmerged)
    models = []
    norms = StepRowNorms(fold=True)
    losses, got = _two_dora_sgd_steps(model_factory, quantized=quantized, norms=norms,
                                      built=lambda model: (unmerged(model), models.append(model)))
    assert simulated[kernels.row_norm_kernel_name(2, True, packed=quantized)].calls >= 1
    dora = [layer for _, layer in models[0].named_modules() if hasattr(layer, "lora_b")]
    with norms(models[0], 16):  # what the step handed every DoRA layer: its factors, in its activations' dtype
        assert dora and all(taken(layer, 16).factors[0].dtype == mx.float32 for layer in dora)
    with no_factors(models[0], 16):
        assert all(taken(layer, 16).factors is None for layer in dora)
    assert losses == want_losses
    for key, value in want.items():
        assert mx.array_equal(got[key], value).item(), key


def test_step_row_norms_leave_dequantizing_to_recomputed_blocks(simulated):
    """Where blocks are recomputed in the backward (gradient checkpointing), a 4-bit layer is
    handed its norm but dequantizes its own weight (one handed over would live for the whole
    step); a dense layer is handed its own weight either way; the loss and gradients do not change.
    Nor is the row scale folded into a weight there (W' = rs W would live for the whole step too)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from meshtune.adapters.step_norms import StepRowNorms, taken

    model = _fan(_dora_layers(quantize=True))
    model.train()

    def norms(recomputed: bool, fold: bool) -> StepRowNorms:  # the fan a block recomputed in the backward, or not
        return StepRowNorms(fold=fold, recomputed=(type(model),) if recomputed else ())

    for recomputed in (False, True):
        with norms(recomputed, fold=True)(model, 10):
            assert (taken(model.layers[0], 10).scaled_weight is None) == recomputed
    x = mx.random.normal((2, 5, 64), key=mx.random.key(4))
    loss_and_grad = nn.value_and_grad(model, lambda x: model(x))
    results = {}
    for recomputed in (False, True):
        with norms(recomputed, fold=False)(model, 10):  # unfolded: the same product both ways, to the bit
            dense_q = taken(model.layers[3], 10).dense_weight  # the 4-bit layer
            dense_d = taken(model.layers[0], 10).dense_weight
            assert (dense_q is None) == recomputed
            assert dense_d is model.layers[0].linear.weight
            results[recomputed] = loss_and_grad(x)
            mx.eval(results[recomputed])
    (v0, g0), (v1, g1) = results[False], results[True]
    assert mx.allclose(v0, v1, rtol=1e-6).item()
    for (name, a), (_, b) in zip(tree_flatten(g0), tree_flatten(g1)):
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-6).item(), name
