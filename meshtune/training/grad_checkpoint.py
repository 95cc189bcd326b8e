"""Gradient checkpointing: a block keeps only its input and runs again when the backward reaches it."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten


def enable_grad_checkpoint(block: nn.Module) -> type[nn.Module]:
    """Recompute every block of this type in the backward pass instead of storing activations; returns
    the class now recomputed, which the training step's per-step work is told (adapters.StepContext's
    `recomputed`: a DoRA step then hands no dequantized weight to a recomputed block's layers).

    A block keeps only its input; its forward runs again when the backward reaches it. The
    recomputation waits for the cotangent of the block's output (`mx.depends`), so it cannot run
    before the backward gets there, however MLX orders the step's graph. mx.checkpoint waits only
    for the forward's output, so a scheduler may recompute every block early and hold all their
    activations at once; torch's non-reentrant checkpoint also recomputes when the gradient arrives.
    """
    cls = type(block)
    fn = cls.__call__

    def checkpointed(module: nn.Module, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        flat = tree_flatten(module.trainable_parameters())
        names, params = [k for k, _ in flat], [v for _, v in flat]

        def forward(x: mx.array, *params: mx.array) -> mx.array:
            module.update(tree_unflatten(list(zip(names, params))))
            return fn(module, x, *args, **kwargs)

        @mx.custom_function
        def block_forward(x: mx.array, *params: mx.array) -> mx.array:
            return forward(x, *params)

        @block_forward.vjp
        def recompute_then_backward(primals: tuple, cotangent: mx.array, output: mx.array) -> tuple:
            inputs = mx.depends(list(primals), [cotangent])
            return tuple(mx.vjp(lambda *p: [forward(*p)], inputs, [cotangent])[1])

        return block_forward(x, *params)

    cls.__call__ = checkpointed
    return cls
