"""Token-weighted evaluation over a split's batches, summed over the ranks."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import mlx.core as mx
import mlx.nn as nn

from ..runtime.mesh import Mesh
from .in_flight import OneInFlight
from .model_loss import loss_terms


def evaluate(model: nn.Module, batches: Iterable[Any], mesh: Mesh,
             beat: Callable[[], None] = lambda: None, overlap: bool = False) -> tuple[float, int]:
    """Token-weighted loss over `batches` on every rank: (loss, global tokens). With `overlap`
    (runtime.overlap_steps) each batch is dispatched before the previous one is waited for.
    """
    model.eval()
    total, tokens = mx.array(0.0), mx.array(0)
    in_flight = OneInFlight(overlap)
    for batch in batches:
        ce, n = loss_terms(model, batch.tokens, batch.lengths)
        total, tokens = total + ce, tokens + n
        in_flight.run([total, tokens], [total, tokens])
        beat()
    in_flight.finish()
    model.train()
    return summed_loss(mesh, total, tokens)


def summed_loss(mesh: Mesh, total: mx.array, tokens: mx.array) -> tuple[float, int]:
    """(loss, tokens) of every rank's summed cross entropy `total` over its `tokens`; nan where none counted."""
    total, tokens = mesh.all_sum(total), mesh.all_sum(tokens)
    n = int(tokens.item())
    return (total.item() / n if n else float("nan")), n
