"""A batch's loss through the whole model: what evaluation reports and what the data-parallel step differentiates.

`loss_terms` is the one loss (summed token cross entropy and its token count) that evaluation
reports; `training_loss_terms` computes the same with the head a chunk of tokens at a time where
the model allows (training/head_loss.py). A pipeline's last stage computes the same (training/losses.py).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..data.packing import packed_caches
from . import HEAD_CHUNK_TOKENS
from .head_loss import head_ce_sum, split_head
from .losses import masked_ce_sum, target_mask


def loss_terms(model: nn.Module, tokens: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
    """(sum of target-token cross entropy, number of target tokens) for one batch.

    Packed rows (3-D `lengths`, data.pack) go through the model with a pass-through cache per
    block whose mask keeps attention inside each example (data/packing.py)."""
    inputs, cache = _model_inputs(model, tokens, lengths)
    return masked_ce_sum(model(inputs) if cache is None else model(inputs, cache=cache), tokens[:, 1:], lengths)


def training_loss_terms(model: nn.Module, tokens: mx.array, lengths: mx.array, *,
                        chunk_tokens: int = HEAD_CHUNK_TOKENS) -> tuple[mx.array, mx.array]:
    """`loss_terms` as the training step differentiates it: where the model's head allows
    (training/head_loss.py), the head and its loss run `chunk_tokens` tokens at a time with their
    gradient taken on the way, so the step never holds the whole batch's logits."""
    head = split_head(model)
    if head is None:
        return loss_terms(model, tokens, lengths)
    inputs, cache = _model_inputs(model, tokens, lengths)
    mask = target_mask(lengths, inputs.shape[1])
    hidden = head.body(inputs) if cache is None else head.body(inputs, cache)
    return head_ce_sum(head, hidden, tokens[:, 1:], mask, chunk_tokens=chunk_tokens), mask.sum()


def _model_inputs(model: nn.Module, tokens: mx.array, lengths: mx.array) -> tuple[mx.array, list | None]:
    """(the model's inputs, all but each row's last token; packed rows' caches or None)."""
    inputs = tokens[:, :-1]
    if lengths.ndim == 3:
        return inputs, packed_caches(len(model.layers), lengths, inputs.shape[1])
    return inputs, None
