"""Sequence packing (data.pack): short examples share rows of max_seq_length tokens, each seeing only itself.

Rows are filled best-fit decreasing, once, so the packing is a pure function of the split and
max_seq_length (`pack_rows`). A packed batch keeps ``Batch(tokens, lengths)``, with one
``(start, first_target, end)`` slot per example of a row (`packed_lengths`). Attention stays inside
each example through mlx-lm's own cache hook (`PackedRows`), which needs RoPE in every block
(`check_packable`). docs/datasets.md ("Packing") says what users see.
"""

from __future__ import annotations

import bisect
from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

FIX = "use --data.pack false"


def pack_rows(lengths: np.ndarray, capacity: int) -> List[np.ndarray]:
    """Example indices of each row, best-fit decreasing (longest example first, into the fullest row it still
    fits); an example over `capacity` fills a row alone (cut)."""
    sizes = np.minimum(np.asarray(lengths, dtype=np.int64), capacity)
    order = np.argsort(-sizes, kind="stable")  # longest first; equal lengths in split order
    rows: List[List[int]] = []
    free: List[tuple] = []  # (room left, row), sorted: the first with enough room is the fullest that fits
    for i in order.tolist():
        n = int(sizes[i])
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            room, row = free.pop(k)
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        if room - n > 1:  # a row with one token of room cannot take an example (at least 2 tokens)
            bisect.insort(free, (room - n, row))
    return [np.asarray(r, dtype=np.int64) for r in rows]


def packed_lengths(offsets: np.ndarray, kept: np.ndarray, slots: int) -> np.ndarray:
    """The [slots, 3] (start, first_target, end) rows of one packed row's examples, in row order.

    A packed batch's ``lengths`` is int32 [B, K, 3], K the most examples any row holds, so every batch
    of a split has one shape; unused slots are 0. ``first_target`` is ``start + max(offset, 1)``: the
    first token of an example is never a target, so the last token of one example never predicts the
    first of the next (training/losses.py).
    """
    out = np.zeros((slots, 3), dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(kept)[:-1]]).astype(np.int64)
    n = kept.shape[0]
    out[:n, 0] = starts
    out[:n, 1] = starts + np.maximum(offsets, 1)
    out[:n, 2] = starts + kept
    return out


def segment_ids(lengths: mx.array, width: int) -> mx.array:
    """[B, width] id of the example each input position belongs to (1-based; 0 is padding)."""
    pos = mx.arange(width)[None, None, :]
    inside = (pos >= lengths[..., 0:1]) & (pos < lengths[..., 2:3])
    ids = mx.arange(1, lengths.shape[1] + 1)[None, :, None]
    return (inside * ids).sum(axis=1)


def block_causal_mask(lengths: mx.array, width: int) -> mx.array:
    """[B, 1, width, width] boolean: a query sees the keys of its own example at or before it."""
    seg = segment_ids(lengths, width)
    pos = mx.arange(width)
    causal = pos[:, None] >= pos[None, :]
    return ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]


class PackedRows:
    """A per-layer stand-in for mlx-lm's KV cache that keeps attention inside each packed example.

    mlx-lm's models build the mask with ``create_attention_mask(h, cache[0])``, which asks
    ``cache.make_mask``, then apply RoPE at ``cache.offset`` and call ``cache.update_and_fetch``.
    Nothing is cached: `update_and_fetch` hands keys and values back and `offset` stays 0, so RoPE
    runs over the row's positions 0..L-1, and `make_mask` gives the block-diagonal causal mask. RoPE
    scores depend only on the distance between two positions, so every score inside an example
    equals the unpacked one: positions in effect restart at each example.
    """

    offset = 0

    def __init__(self, mask: mx.array) -> None:
        self.mask = mask

    def make_mask(self, n: int, return_array: bool = False, window_size: Optional[int] = None) -> mx.array:
        assert n == self.mask.shape[-1], "the packed mask is built for the row's width"
        if window_size is None:
            return self.mask
        pos = mx.arange(n)
        return self.mask & ((pos[:, None] - pos[None, :]) < window_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return keys, values


def packed_caches(count: int, lengths: mx.array, width: int) -> List[PackedRows]:
    """One `PackedRows` per block (they share the mask), for `model(inputs, cache=...)`."""
    cache = PackedRows(block_causal_mask(lengths, width))
    return [cache] * count


def _has_rope(block: nn.Module) -> bool:
    return any(isinstance(m, nn.RoPE) or "rope" in type(m).__name__.lower()
               for _, m in block.named_modules())


def check_packable(model: Any) -> None:
    """Raise a one-line ValueError unless every block of `model` applies RoPE (relative positions): without
    it in every block, positions would run across packed examples."""
    layers = getattr(model, "layers", None)
    if not layers:
        raise ValueError(f"data.pack: {type(model).__name__} has no mlx-lm block list (model.layers) to "
                         f"keep packed examples apart; {FIX}")
    for i, block in enumerate(layers):
        if not _has_rope(block):
            raise ValueError(f"data.pack: block {i} of {type(model).__module__.rsplit('.', 1)[-1]} has no rotary "
                             "position embedding (RoPE), so packed examples would not keep their own positions; "
                             f"{FIX}")
