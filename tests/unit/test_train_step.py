"""The compiled step: token weighting, accumulation, clipping and the bad-step gate, on a tiny model in code."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten, tree_map

from meshtune.adapters import apply_adapters, trainable_parameters
from meshtune.runtime.mesh import Mesh
from meshtune.parallel.data_parallel_step import build_step
from meshtune.training.model_loss import loss_terms, training_loss_terms


def _batch(rows: list[list[int]], offsets: list[int], width: int = 9):
    tokens = mx.zeros((len(rows), width), dtype=mx.int32)
    arr = [[*r, *([0] * (width - len(r)))] for r in rows]
    tokens = mx.array(arr, dtype=mx.int32)
    lengths = mx.array([[o, len(r)] for r, o in zip(rows, offsets)], dtype=mx.int32)
    return tokens, lengths


ROWS = [[1, 5, 7, 9, 2], [3, 4, 8, 8, 8, 8, 6, 2], [11, 12, 2], [5, 6, 7, 8, 9, 10, 2]]
OFFS = [1, 3, 0, 2]


def test_loss_counts_only_real_targets(model_factory):
    model = model_factory()
    tokens, lengths = _batch(ROWS, OFFS)
    _, n = loss_terms(model, tokens, lengths)
    # Row with length L and prompt offset o contributes L - max(o, 1) targets.
    assert n.item() == sum(len(r) - max(o, 1) for r, o in zip(ROWS, OFFS))


@pytest.mark.parametrize("packed", [False, True])
def test_padding_columns_change_neither_the_loss_nor_its_gradients(model_factory, packed):
    """What data/batches.py's inputs_multiple_of adds (on CUDA) leaves the step's results alone."""
    model = model_factory()
    value_and_grad = nn.value_and_grad(model, training_loss_terms)

    def run(width):
        tokens, lengths = _batch(ROWS, OFFS, width)
        if packed:  # rows 0+2 and 1+3 packed: (start, first target, end) slots
            tokens, _ = _batch([[*ROWS[0], *ROWS[2]], [*ROWS[1], *ROWS[3]]], [0, 0], width)
            lengths = mx.array([[[0, 1, 5], [5, 6, 8]], [[0, 3, 8], [8, 10, 15]]])
        (ce, n), grads = value_and_grad(model, tokens, lengths)
        mx.eval(ce, n, grads)
        return ce.item(), n.item(), dict(tree_flatten(grads))

    ce, n, grads = run(16)
    wide_ce, wide_n, wide_grads = run(16 + 48)
    assert wide_n == n > 0 and wide_ce == pytest.approx(ce, rel=1e-6)
    for k, g in grads.items():
        assert mx.allclose(wide_grads[k], g, rtol=1e-5, atol=1e-6 * mx.abs(g).max().item()).item(), k


def _run(model_factory, micro_batches, clip=0.0, compile=True):
    model = model_factory(seed=3)
    apply_adapters(model, fine_tune_type="lora", num_layers=-1, keys=None, rank=4, scale=10.0, dropout=0.0)
    # Non-zero B so every adapter parameter gets a gradient.
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_b = mx.full(m.lora_b.shape, 0.01)
    opt = optim.SGD(learning_rate=0.1)
    opt.init(model.trainable_parameters())
    step = build_step(model, opt, Mesh.single(), max_grad_norm=clip, compile=compile)
    grads = ntoks = None
    for rows, offs in micro_batches[:-1]:
        _, _, grads, ntoks = step.accumulate(*_batch(rows, offs), grads, ntoks)
        mx.eval(model.state, opt.state, grads, ntoks)
    for rows, offs in micro_batches[-1:]:
        _, _, verdict = step.finish(*_batch(rows, offs), grads, ntoks)
        mx.eval(model.state, opt.state, verdict.arrays())
    return trainable_parameters(model)


@pytest.mark.parametrize("compile", [True, False])
def test_accumulation_equals_one_big_batch(model_factory, compile):
    start = _run(model_factory, [], compile=compile)  # no step: the weights both runs start from
    whole = _run(model_factory, [(ROWS, OFFS)], compile=compile)
    split = _run(model_factory, [(ROWS[:1], OFFS[:1]), (ROWS[1:], OFFS[1:])], compile=compile)
    moved = max(mx.abs(whole[k] - start[k]).max().item() for k in whole)
    assert moved > 1e-3, moved  # the update happened: a no-op step would make whole == split trivially
    for k in whole:
        assert mx.allclose(whole[k], split[k], atol=1e-5), k


def test_clipping_bounds_the_update(model_factory):
    free = _run(model_factory, [(ROWS, OFFS)])
    clipped = _run(model_factory, [(ROWS, OFFS)], clip=1e-3)
    model = model_factory(seed=3)
    apply_adapters(model, fine_tune_type="lora", num_layers=-1, keys=None, rank=4, scale=10.0, dropout=0.0)
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_b = mx.full(m.lora_b.shape, 0.01)
    start = trainable_parameters(model)
    moved = lambda p: sum(((p[k] - start[k]) ** 2).sum().item() for k in p) ** 0.5  # noqa: E731
    assert moved(clipped) == pytest.approx(0.1 * 1e-3, rel=1e-3)
    assert moved(free) > 10 * moved(clipped)


def test_grad_checkpoint_returns_the_blocks_it_recomputes():
    """adapters/step_norms.py leaves dequantizing to recomputed blocks: the run's StepContext is told which."""
    import mlx.nn as nn

    from meshtune.training.grad_checkpoint import enable_grad_checkpoint

    class Block(nn.Module):
        def __call__(self, x):
            return x

    assert enable_grad_checkpoint(Block()) is Block


def test_the_loop_imports_no_adapter_transport_or_layout():
    """The loop calls a strategy (training/strategy.py): importing it loads no adapter, transport or layout."""
    import subprocess
    import sys
    from pathlib import Path

    import meshtune.training.loop as loop

    code = "import sys, meshtune.training.loop; print(' '.join(m for m in sys.modules if m.startswith('meshtune')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "meshtune.training.loop" in loaded
    for module in ("meshtune.adapters", "meshtune.parallel.socket_ring", "meshtune.parallel.data_parallel",
                   "meshtune.parallel.pipeline.executor"):
        assert module not in loaded, module
    assert "pipeline" not in Path(loop.__file__).read_text().lower()


def test_the_update_clips_as_mlx_does():
    """training/update.apply_update on a mixed-dtype tree: the step mlx's clip_grad_norm gives, bit for bit."""
    from mlx.utils import tree_flatten, tree_map

    from meshtune.training.update import apply_update

    grads = {"a": mx.array([[3.0, -4.0]]), "b": mx.array([1.5, 2.5], dtype=mx.bfloat16),
             "c": mx.array([0.25], dtype=mx.float16)}
    tokens = mx.array(3)
    params = {k: mx.ones_like(g) for k, g in grads.items()}
    want = dict(params)
    clipped, _ = optim.clip_grad_norm(tree_map(lambda g: g / tokens.astype(g.dtype), grads), 0.5)
    want = optim.SGD(learning_rate=0.1).apply_gradients(clipped, want)

    import mlx.nn as nn

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = params["a"], params["b"], params["c"]

    holder = Holder()
    apply_update(holder, optim.SGD(learning_rate=0.1), grads, tokens, max_grad_norm=0.5)
    got = dict(tree_flatten(holder.parameters()))
    for k, v in tree_flatten(want):
        assert got[k].dtype == v.dtype and mx.array_equal(got[k], v).item(), k


def _bad_step_setup(model_factory, optimizer):
    model = model_factory(seed=3)
    apply_adapters(model, fine_tune_type="lora", num_layers=-1, keys=None, rank=4, scale=10.0, dropout=0.0)
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_b = mx.full(m.lora_b.shape, 0.01)
    optimizer.init(model.trainable_parameters())
    mx.eval(model.parameters(), optimizer.state)
    return model


def _snapshot(model, optimizer):
    return ({k: mx.array(v) for k, v in trainable_parameters(model).items()},
            {k: mx.array(v) for k, v in tree_flatten(optimizer.state) if isinstance(v, mx.array)})


def _assert_unchanged(before, model, optimizer):
    params, state = _snapshot(model, optimizer)
    assert params.keys() == before[0].keys() and state.keys() == before[1].keys()
    for k in params:
        assert mx.array_equal(params[k], before[0][k]).item(), k
    for k in state:
        assert mx.array_equal(state[k], before[1][k], equal_nan=True).item(), k  # a nan schedule stays nan


@pytest.mark.parametrize("compile", [True, False])
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_zero_token_global_batch_is_not_applied(model_factory, compile, clip):
    """Lengths that leave no target in any micro-batch: the step is bad, nothing moves (AdamW state too)."""
    opt = optim.AdamW(learning_rate=0.1)
    model = _bad_step_setup(model_factory, opt)
    step = build_step(model, opt, Mesh.single(), max_grad_norm=clip, compile=compile)
    before = _snapshot(model, opt)
    # offset >= length: no targets in either micro-batch
    _, n, grads, ntoks = step.accumulate(*_batch(ROWS, [9, 9, 9, 9]), None, None)
    mx.eval(model.state, opt.state, grads, ntoks)
    assert n.item() == 0
    _, n, verdict = step.finish(*_batch(ROWS, [5, 8, 3, 7]), grads, ntoks)
    ok, norm, tokens, _ = verdict.arrays()
    mx.eval(model.state, opt.state, ok, norm, tokens)
    assert n.item() == 0
    assert not ok.item() and tokens.item() == 0 and not mx.isfinite(norm).item()
    _assert_unchanged(before, model, opt)
    # The next good step is applied as usual.
    ok = step.finish(*_batch(ROWS, OFFS), None, None)[2].ok
    mx.eval(model.state, opt.state, ok)
    assert ok.item()
    assert any(not mx.array_equal(v, before[0][k]).item() for k, v in trainable_parameters(model).items())


@pytest.mark.parametrize("compile", [True, False])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_non_finite_gradient_is_not_applied(model_factory, compile, poison):
    """A frozen weight gone non-finite makes the loss and gradients non-finite: no update, state kept."""
    opt = optim.AdamW(learning_rate=0.1)
    model = _bad_step_setup(model_factory, opt)
    step = build_step(model, opt, Mesh.single(), max_grad_norm=0.0, compile=compile)
    ok = step.finish(*_batch(ROWS, OFFS), None, None)[2].ok  # one good step: AdamW state non-zero
    mx.eval(model.state, opt.state, ok)
    assert ok.item()
    before = _snapshot(model, opt)
    norm_weight = model.model.norm.weight
    model.model.norm.weight = mx.full(norm_weight.shape, poison)
    ce, _, verdict = step.finish(*_batch(ROWS, OFFS), None, None)
    ok, norm, tokens, _ = verdict.arrays()
    mx.eval(model.state, opt.state, ok, norm, ce)
    assert not ok.item() and not mx.isfinite(norm).item() and tokens.item() > 0
    assert not mx.isfinite(ce).item()
    _assert_unchanged(before, model, opt)


@pytest.mark.parametrize("compile", [True, False])
@pytest.mark.parametrize("make", [
    lambda: optim.SGD(learning_rate=1e39),  # inf in float32: a finite gradient times inf
    lambda: optim.SGD(learning_rate=1e39, momentum=0.9),
    lambda: optim.AdamW(learning_rate=1e39),
    lambda: optim.AdamW(learning_rate=0.1, weight_decay=float("nan")),
    lambda: optim.Adam(learning_rate=optim.linear_schedule(float("nan"), 0.1, 3)),
], ids=["sgd-inf-lr", "sgd-momentum-inf-lr", "adamw-inf-lr", "adamw-nan-decay", "adam-nan-warmup"])
def test_an_update_that_would_make_non_finite_weights_is_not_applied(model_factory, compile, make):
    """A finite gradient whose update overflows (or meets a nan setting) is a bad step like a non-finite
    gradient: ok is false, the norm is finite, `finite` says why, and no parameter or state moves."""
    opt = make()
    model = _bad_step_setup(model_factory, opt)
    step = build_step(model, opt, Mesh.single(), max_grad_norm=0.0, compile=compile)
    before = _snapshot(model, opt)
    _, _, verdict = step.finish(*_batch(ROWS, OFFS), None, None)
    ok, norm, tokens, finite = verdict.arrays()
    mx.eval(model.state, opt.state, ok, norm, tokens, finite)
    assert not ok.item() and not finite.item() and mx.isfinite(norm).item() and tokens.item() > 0
    assert "non-finite weights or optimizer state" in verdict.describe()
    _assert_unchanged(before, model, opt)


def test_a_large_parameter_keeps_each_element_whose_update_is_not_finite():
    """A parameter updated in place (IN_PLACE_FROM elements or more) holds back element by element:
    no weight or moment ever becomes non-finite, and a finite element's update lands as mlx makes it."""
    from meshtune.training.update import IN_PLACE_FROM, apply_update

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = mx.ones((IN_PLACE_FROM,), dtype=mx.float16)

    model, opt = Holder(), optim.Adam(learning_rate=1e-3)
    opt.init(model.trainable_parameters())
    # The norm's squares are summed in float32 (finite); in float16 the squares of 300 overflow v.
    grads = {"w": mx.ones((IN_PLACE_FROM,), dtype=mx.float16).at[:2].multiply(300)}
    verdict = apply_update(model, opt, grads, mx.array(1), max_grad_norm=0.0)
    mx.eval(model.parameters(), opt.state, verdict.arrays())
    assert mx.isfinite(model.w).all().item() and mx.isfinite(opt.state["w"]["v"]).all().item()
    assert (model.w[:2] == 1).all().item() and (model.w[2:] < 1).all().item()


def test_a_finite_step_is_bit_identical_to_the_plain_update(model_factory):
    """The gate's where(ok, new, old) returns the new arrays bit for bit."""
    got = _run(model_factory, [(ROWS, OFFS)], clip=0.5)
    model = _bad_step_setup(model_factory, optim.SGD(learning_rate=0.1))
    opt = optim.SGD(learning_rate=0.1)
    opt.init(model.trainable_parameters())
    (_, n), grads = nn.value_and_grad(model, training_loss_terms)(model, *_batch(ROWS, OFFS))
    grads = optim.clip_grad_norm(tree_map(lambda g: g / n.astype(g.dtype), grads), 0.5)[0]
    opt.update(model, grads)
    for k, v in trainable_parameters(model).items():
        assert mx.array_equal(v, got[k]).item(), k


@pytest.mark.parametrize("in_place_from", [1 << 20, 1], ids=["fused", "in-place"])
@pytest.mark.parametrize("compile", [True, False])
@pytest.mark.parametrize("make", [
    lambda: optim.Adam(learning_rate=0.01),
    lambda: optim.Adam(learning_rate=0.01, bias_correction=True),
    lambda: optim.AdamW(learning_rate=0.01, weight_decay=0.1),
    lambda: optim.AdamW(learning_rate=optim.cosine_decay(0.01, 10), bias_correction=True),
], ids=["adam", "adam-bias-correction", "adamw", "adamw-schedule-bias-correction"])
def test_the_gated_adam_is_mlx_adam_bit_for_bit(make, compile, in_place_from):
    """Adam and AdamW take the gate inside their update (training/update._gated_adam): on good steps the
    parameters and every optimizer state array equal mlx's own optimizer's, bit for bit, in float32 and
    bfloat16, whether a parameter's update is one kernel or runs in place (here every parameter's, by
    IN_PLACE_FROM); then a bad step (no tokens) changes nothing, its step counter and learning rate included."""
    from meshtune.training.update import apply_update

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = mx.random.normal((6, 5), key=mx.random.key(1))
            self.h = mx.random.normal((7,), key=mx.random.key(2)).astype(mx.bfloat16)

    ours, theirs = Holder(), Holder()
    theirs.update(tree_map(lambda p: p, ours.parameters()))
    opt_ours, opt_theirs = make(), make()
    opt_ours.init(ours.trainable_parameters())
    opt_theirs.init(theirs.trainable_parameters())
    state = [ours.state, opt_ours.state]

    def update(grads, tokens):
        return apply_update(ours, opt_ours, grads, tokens, max_grad_norm=0.0, in_place_from=in_place_from).arrays()

    update = mx.compile(update, inputs=state, outputs=state) if compile else update
    for i in range(3):
        grads = {"w": mx.random.normal((6, 5), key=mx.random.key(10 + i)) * 7,
                 "h": (mx.random.normal((7,), key=mx.random.key(20 + i)) * 7).astype(mx.bfloat16)}
        tokens = mx.array(7)
        ok, *_ = update(grads, tokens)
        opt_theirs.update(theirs, tree_map(lambda g: g / tokens.astype(g.dtype), grads))
        mx.eval(state, ok, theirs.parameters(), opt_theirs.state)
        assert ok.item()
        for (k, a), (_, b) in zip(tree_flatten([ours.parameters(), opt_ours.state]),
                                  tree_flatten([theirs.parameters(), opt_theirs.state])):
            assert a.dtype == b.dtype and mx.array_equal(a, b).item(), k
    before = [tree_map(lambda x: x, ours.parameters()), tree_map(lambda x: x, opt_ours.state)]
    ok, *_ = update(grads, mx.array(0))
    mx.eval(state, ok)
    assert not ok.item()
    for (k, a), (_, b) in zip(tree_flatten([ours.parameters(), opt_ours.state]), tree_flatten(before)):
        assert mx.array_equal(a, b).item(), k


@pytest.mark.parametrize("clip", [0.0, 0.5], ids=["no-clip", "clip"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_large_parameter_s_adam_update_runs_in_place(dtype, clip):
    """A parameter of IN_PLACE_FROM elements or more is updated in place: the compiled gated AdamW
    update of three such parameters allocates nothing beyond the arrays it replaces (new weights and
    moments take the old ones' buffers), with or without clipping, where the update fused into one
    kernel per parameter allocates a second copy of the weights and both moments (3 x their bytes,
    checked as the contrast)."""
    from meshtune.training.update import IN_PLACE_FROM, apply_update

    def new_bytes(in_place_from: int) -> float:
        class Holder(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = mx.ones((IN_PLACE_FROM // 512, 512), dtype=dtype)
                self.b = mx.ones((IN_PLACE_FROM // 256, 512), dtype=dtype)
                self.c = mx.ones((IN_PLACE_FROM,), dtype=dtype)

        model, opt = Holder(), optim.AdamW(learning_rate=1e-3)
        opt.init(model.trainable_parameters())
        state = [model.state, opt.state]
        weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        update = mx.compile(lambda g, t: apply_update(model, opt, g, t, max_grad_norm=clip,
                                                      in_place_from=in_place_from).arrays(),
                            inputs=state, outputs=state)
        grown = []
        for i in range(3):
            grads = tree_map(lambda p: mx.random.normal(p.shape, key=mx.random.key(i)).astype(dtype),
                             model.trainable_parameters())
            mx.eval(grads, state)
            before = mx.get_active_memory()
            mx.reset_peak_memory()
            outputs = update(grads, mx.array(3))
            del grads
            mx.eval(outputs, state)
            assert outputs[0].item()
            grown.append(max(0, mx.get_peak_memory() - before) / weights)
        return max(grown[1:])  # the first update makes the moments' first values

    # The gradients' squares for the norm and a few scalars are the update's only new arrays.
    assert new_bytes(IN_PLACE_FROM) <= 1.05
    assert new_bytes(1 << 40) >= 3.0


def test_each_small_parameter_s_gated_adam_update_is_one_kernel(tmp_path):
    """MLX's compiler fuses each parameter's whole gated AdamW update (division, moments, parameter,
    selects) into one kernel where the parameter is under IN_PLACE_FROM elements: in the compiled update's graph every array-wide select sits inside the
    kernel that takes the square root, one such kernel a parameter (the others: the norm's reductions
    and the step counter's scalars)."""
    import re

    from meshtune.training.update import apply_update

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = mx.ones((16, 8)), mx.ones((8,)), mx.ones((4, 4))

    model, opt = Holder(), optim.AdamW(learning_rate=1e-3)
    opt.init(model.trainable_parameters())
    state = [model.state, opt.state]
    update = mx.compile(lambda g, t: apply_update(model, opt, g, t, max_grad_norm=0.0).arrays(),
                        inputs=state, outputs=state)
    grads = tree_map(lambda p: mx.full(p.shape, 0.5), model.trainable_parameters())
    mx.eval(update(grads, mx.array(3)), state)
    outputs = update(grads, mx.array(3))
    mx.export_to_dot(str(tmp_path / "update.dot"), *outputs, *[v for _, v in tree_flatten(state)])
    labels = re.findall(r'label ="([A-Za-z]+)', (tmp_path / "update.dot").read_text())
    updates = [label for label in labels if "Sqrt" in label and "Select" in label and "Divide" in label]
    assert len(updates) == 3, labels
    wide_selects = [label for label in labels if "Select" in label and label not in updates]
    assert len(wide_selects) <= 2, labels  # the step counter and the learning rate, scalars
