"""A pipeline's weights and optimizer state assembled from its stages, and split back.

Each stage trains and keeps optimizer state only for its own blocks. Saves gather
both onto every rank in the single-process layout (global parameter names such as
model.layers.5...), so rank 0 writes checkpoints and adapters exactly as one process
would, stock mlx-lm loads the adapters, and a resumed run (any number of stages)
takes from them what its stage trains. Gathering is one world all_sum per tensor, in
which only the owner contributes (replica 0's copy; the first stage's for a tied
table), so the values arrive bit for bit on every backend, ring included.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .pipeline import PipelineStage


def _owned(stage: PipelineStage) -> set[str]:
    """Trained parameter names this rank contributes when gathering."""
    if stage.mesh.dp_rank != 0:
        return set()
    own = set(dict(tree_flatten(stage.model.trainable_parameters())))
    return own if stage.first else own - set(stage.tied_keys)


def gather_parameters(stage: PipelineStage, keys: list[str]) -> dict[str, mx.array]:
    """The current values of `keys` from whichever stage trains each, on every rank."""
    values = dict(tree_flatten(stage.model.parameters()))
    own = _owned(stage)
    out = {k: stage.mesh.all_sum(values[k] if k in own else mx.zeros_like(values[k])) for k in keys}
    mx.eval(out)
    return out


def gather_optimizer_state(stage: PipelineStage, optimizer: Any) -> dict[str, mx.array]:
    """The whole model's optimizer state, flat ("<parameter>.<slot>", plus step and rate).

    Slots of parameters other stages train are shaped here from the optimizer's own
    `init_single` on a lazy stand-in (never evaluated), so every rank joins the same
    all_sums in the same order whatever the optimizer.
    """
    state = dict(tree_flatten(optimizer.state))
    params = {k: (shape, dtype) for k, shape, dtype in stage.all_params}
    own = _owned(stage)
    out = {k: v for k, v in state.items() if k.rsplit(".", 1)[0] not in params}  # step, learning_rate: shared
    for k, (shape, dtype) in params.items():
        slots: dict[str, Any] = {}
        optimizer.init_single(mx.zeros(shape, dtype), slots)
        for name, template in tree_flatten(slots):
            key = f"{k}.{name}"
            out[key] = stage.mesh.all_sum(state[key] if k in own else mx.zeros_like(template))
    mx.eval(out)
    return out


def stage_optimizer_state(stage: PipelineStage, flat: dict[str, mx.array]) -> Any:
    """From a whole model's flat optimizer state, the tree this stage's optimizer keeps."""
    params = {k for k, _, _ in stage.all_params}
    own = set(dict(tree_flatten(stage.model.trainable_parameters())))
    keep = [(k, v) for k, v in flat.items() if k.rsplit(".", 1)[0] in own or k.rsplit(".", 1)[0] not in params]
    return tree_unflatten(keep)
