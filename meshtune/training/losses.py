"""Token-level losses shared by the single-process step and the pipeline's last stage.

Both must count exactly the same targets, or a pipeline would not reproduce the
single-process run; so the mask and the summed cross entropy live here, once.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def target_mask(lengths: mx.array, targets: int) -> mx.array:
    """Which of `targets` target positions count, per row.

    `lengths[:, 0]` is the prompt offset and `lengths[:, 1]` the sequence length L, as in
    mlx-lm. Target position p (1-based, predicting token p) counts when offset <= p < L;
    mlx-lm's `p <= L` also trains one padding target per padded row (its PR #1697).
    Packed rows (data.pack) carry [B, K, 3] (start, first target, end) slots instead: a target
    counts inside one example's [first target, end), never across a boundary (data/packing.py).
    """
    steps = mx.arange(1, targets + 1)
    if lengths.ndim == 3:
        return ((steps >= lengths[..., 1:2]) & (steps < lengths[..., 2:3])).any(axis=1)
    return (steps >= lengths[:, 0:1]) & (steps < lengths[:, 1:])


def masked_ce_sum(logits: mx.array, targets: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
    """(sum of the counted targets' cross entropy, how many were counted)."""
    mask = target_mask(lengths, targets.shape[1])
    ce = nn.losses.cross_entropy(logits, targets) * mask
    return ce.astype(mx.float32).sum(), mask.sum()
