"""A pipeline stage compiled (train.compile) computes what the uncompiled stage does, micro-batch after micro-batch."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map

from support import tiny_llama
from meshtune.adapters import apply_adapters
from meshtune.runtime.mesh import Mesh
from meshtune.parallel.pipeline.stage import PipelineStage


def _stage(k: int, compile: bool) -> PipelineStage:
    """Stage k of 2 over the tiny tied model with LoRA (non-zero B, so every gradient is live)."""
    model = tiny_llama(layers=4, dim=32, vocab=64, seed=0)
    apply_adapters(model, fine_tune_type="lora", num_layers=-1, keys=None, rank=4, scale=10.0, dropout=0.0)
    for _, m in model.named_modules():
        if "lora_b" in m:
            m.lora_b = mx.random.normal(m.lora_b.shape, key=mx.random.key(1)) * 0.01
    mx.eval(model.parameters())
    return PipelineStage(model, k, 2, Mesh(group=None, world_size=1, rank=k, dp=1, pp=2), compile=compile)


def _close(a, b) -> None:
    flat_a, flat_b = dict(tree_flatten(a)), dict(tree_flatten(b))
    assert flat_a.keys() == flat_b.keys() and flat_a
    for k in flat_a:
        assert mx.allclose(flat_a[k], flat_b[k], rtol=1e-5, atol=1e-6), k


@pytest.mark.parametrize("width", [17, 9])  # a second shape traces a second graph
def test_compiled_stages_match_uncompiled(width):
    tokens = mx.random.randint(1, 64, (4, width), key=mx.random.key(2)).astype(mx.int32)
    lengths = mx.array([[0, width], [0, width - 3], [0, 5], [0, width - 1]], dtype=mx.int32)
    x, targets = tokens[:, :-1], tokens[:, 1:]
    (first, last), (first_c, last_c) = [[_stage(k, c) for k in (0, 1)] for c in (False, True)]
    assert first_c.forward is not first_c.hidden and first.forward == first.hidden
    for _ in range(2):  # the compiled graphs read the weights as they are at each call
        h, h_c = first.forward(x, lengths), first_c.forward(x, lengths)
        _close(h, h_c)
        loss, grads, dx = last.backward(h, targets, lengths, None)
        loss_c, grads_c, dx_c = last_c.backward(h, targets, lengths, None)
        _close([loss, grads, dx], [loss_c, grads_c, dx_c])
        value, grads0, none = first.backward(x, targets, lengths, dx)
        value_c, grads0_c, none_c = first_c.backward(x, targets, lengths, dx)
        assert none is None and none_c is None
        _close([value, grads0], [value_c, grads0_c])
        for stage, g in ((first, grads0), (last, grads), (first_c, grads0_c), (last_c, grads_c)):
            stage.model.update(_sgd(stage, g))
        mx.eval([s.model.parameters() for s in (first, last, first_c, last_c)])


def _sgd(stage: PipelineStage, grads):
    """Plain SGD on the stage's trained parameters (what changes between two compiled calls)."""
    return tree_map(lambda p, g: p - 0.5 * g, stage.model.trainable_parameters(), grads)
