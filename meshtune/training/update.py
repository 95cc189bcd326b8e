"""The optimizer update every parallel strategy makes: divide by the tokens, clip, apply.

Gradients arrive as sums of token losses (already summed over whatever ranks hold the
same parameters) and the token count of the whole global batch, so the update equals
one process's on that batch. Clipping follows mlx's `optim.clip_grad_norm` (the scale
min(max_norm / (||g|| + 1e-6), 1) applied to each gradient, cast back to its dtype);
only the global norm's square-sum differs by strategy: local for data parallelism,
summed across stages for a pipeline (parallel/pipeline.py).
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_map, tree_reduce


def local_square_sum(grads: Any) -> mx.array:
    """Sum of every gradient's squares, as optim.clip_grad_norm takes it (float16 summed in float32)."""
    def squares(g: mx.array) -> mx.array:
        return (g.astype(mx.float32) if g.dtype == mx.float16 else g).square().sum()

    return tree_reduce(lambda acc, g: acc + squares(g), grads, 0.0)


def apply_update(model: nn.Module, optimizer: optim.Optimizer, grads: Any, tokens: mx.array, *,
                 max_grad_norm: float, square_sum: Callable[[Any], mx.array] = local_square_sum) -> None:
    """Update `model` from summed `grads` and the global `tokens`; clip to `max_grad_norm` (0: off).

    `square_sum(grads)` is the square of the global gradient norm, over every parameter
    of the model once, whichever rank holds it.
    """
    grads = tree_map(lambda g: g / tokens.astype(g.dtype), grads)
    if max_grad_norm > 0:
        scale = mx.minimum(max_grad_norm / (mx.sqrt(square_sum(grads)) + 1e-6), 1.0)
        # Cast after scaling, as mlx does, so a small scale does not underflow in float16.
        grads = tree_map(lambda g: (g * scale).astype(g.dtype), grads)
    optimizer.update(model, grads)
