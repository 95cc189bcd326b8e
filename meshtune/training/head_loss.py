"""The head and its cross entropy a chunk of tokens at a time, their gradient taken on the way.

A step's logits are tokens x vocabulary, and the plain loss (losses.masked_ce_sum) keeps them
for the backward pass, which then forms their gradient, as large again (the sizes:
docs/performance.md, "The head and its loss a chunk of tokens at a time"). `head_ce_sum` takes
the head's logits, their cross entropy and its gradients HEAD_CHUNK_TOKENS tokens at a time, so
one chunk's logits are alive at a time, and recomputes none of the plain loss's three matmuls.
`split_head` says which models it handles; other models take the plain loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import HEAD_CHUNK_TOKENS, HEAD_THEN_LOGITS

SUM_IN_FLOAT32_ABOVE = 4
"""Chunks beyond which a trained head's weight gradient is summed in float32. Summed in bfloat16,
4 chunks come as close to a float32 reference as the plain loss's one matmul (7.5e-3 against
7.2e-3), 64 do not (1.2e-2); the float32 sum costs 4 bytes a weight while it runs."""


@dataclass
class Head:
    """A model cut before its head: `body(inputs, cache)` gives the final-normed hidden states."""

    body: nn.Module
    apply: Callable[[mx.array], mx.array]
    """hidden states -> logits, with the head's weights as the model holds them."""
    weight_module: nn.Module | None
    """The nn.Linear or nn.Embedding whose `weight` trains, or None when the head is frozen."""


def split_head(model: nn.Module) -> Head | None:
    """`model` as body and head when its logits are head(body(x)) and the head is one this module handles:
    the mlx-lm families in HEAD_THEN_LOGITS (a test checks each against the model's own logits), with a
    head that is frozen or a plain bias-free weight."""
    body = getattr(model, "model", None)
    if getattr(model, "model_type", None) not in HEAD_THEN_LOGITS or body is None:
        return None
    tied = "lm_head" not in model
    module = body.embed_tokens if tied else model.lm_head
    trainable = {k for k, _ in tree_flatten(module.trainable_parameters())}
    if not trainable:
        return Head(body, module.as_linear if tied else module, None)
    if trainable == {"weight"} and type(module) is (nn.Embedding if tied else nn.Linear) and "bias" not in module:
        return Head(body, module.as_linear if tied else module, module)
    return None


def head_ce_sum(head: Head, hidden: mx.array, targets: mx.array, mask: mx.array, *,
                chunk_tokens: int = HEAD_CHUNK_TOKENS) -> mx.array:
    """The summed cross entropy of the counted (`mask`) targets, in float32, as masked_ce_sum's
    first value, with its gradient to `hidden` (and the head's weight) taken in the forward pass,
    `chunk_tokens` tokens at a time.

    Each chunk runs after the one before (mx.depends), so one chunk's logits are alive at a time.
    The backward pass only scales the stored gradients by the loss's cotangent (mx.custom_function).
    """
    x = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    m = mask.reshape(-1)
    bounds = [(a, min(a + chunk_tokens, x.shape[0])) for a in range(0, x.shape[0], chunk_tokens)]
    trained = head.weight_module is not None

    @mx.custom_function
    def loss_and_gradients(x: mx.array, *weight: mx.array) -> tuple[mx.array, ...]:
        """(loss, its gradient to x[, to the head's weight]): each chunk after the one before."""
        total, dx, dw = mx.array(0.0, dtype=mx.float32), [], None
        sum_dtype = mx.float32 if len(bounds) > SUM_IN_FLOAT32_ABOVE else weight[0].dtype if trained else None
        for a, b in bounds:
            xc = x[a:b] if a == 0 else mx.depends(x[a:b], [total, dx[-1]] + ([] if dw is None else [dw]))
            logits = head.apply(xc)
            tc, mc = t[a:b], m[a:b]
            ce = nn.losses.cross_entropy(logits, tc).astype(mx.float32)
            total = total + (ce * mc).sum()
            lse = ce + mx.take_along_axis(logits, tc[:, None], axis=-1).squeeze(-1).astype(mx.float32)
            hot = mx.arange(logits.shape[-1]) == tc[:, None]
            g = ((mx.exp(logits.astype(mx.float32) - lse[:, None]) - hot) * mc[:, None]).astype(logits.dtype)
            dx.append(mx.vjp(head.apply, [xc], [g])[1][0])
            if not trained:
                continue
            if dw is not None and dw.dtype == g.dtype == xc.dtype:
                dw = mx.addmm(dw, g.T, xc)
            else:  # the first chunk, a float32 sum, or a head wider than the hidden states
                part = (g.T @ xc).astype(sum_dtype)
                dw = part if dw is None else dw + part
        dx = mx.concatenate(dx) if len(dx) > 1 else dx[0]
        return (total, dx) if not trained else (total, dx, dw.astype(weight[0].dtype))

    @loss_and_gradients.vjp
    def scale_gradients(primals, cotangents, outputs):
        return tuple(g * cotangents[0].astype(g.dtype) for g in outputs[1:])

    weights = [head.weight_module.weight] if trained else []
    return loss_and_gradients(x, *weights)[0]
