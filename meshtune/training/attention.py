"""Causal attention a chunk of queries at a time, with a hand-written backward: memory linear in the row.

MLX's fused attention has no fused backward on the CPU or on Apple GPUs
(`ScaledDotProductAttentionVJP::use_fallback`), so training there forms every head's L x L
scores and probabilities, and the backward several more arrays of that size (what that costs:
docs/performance.md, "Long rows"). Here the queries go a chunk of rows at a time against the
keys up to the chunk's end, and the backward recomputes a chunk's probabilities from the output
and each row's log-sum-exp (FlashAttention's backward, in MLX ops; `causal_attention`). A run
installs it where MLX has no fused backward (`needs_chunked_attention`,
`install_chunked_attention`); on NVIDIA GPUs MLX's cuDNN attention does this already.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

from ..runtime.model_modules import replace_in_models
from . import ATTENTION_CHUNK, ATTENTION_CHUNKED_FROM

LOG2_E = math.log2(math.e)


def needs_chunked_attention() -> bool:
    """Whether this device's fused attention lacks a backward: the CPU, and Apple GPUs (Metal)."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return True
    return mx.metal.is_available()


def causal_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, chunk: int = ATTENTION_CHUNK) -> mx.array:
    """softmax(scale q k^T, causal) v for q (B, H, L, D) and k, v (B, KV, L, D), H a multiple of KV.

    The forward keeps the output and each row's log-sum-exp (base 2); the backward recomputes a chunk's
    probabilities from them. Each chunk runs after the one before (`mx.depends`), so one chunk's
    scores, heads x chunk x L, are alive at a time.
    """
    batch, heads, length, dim = q.shape
    groups = k.shape[1]
    shape = (batch, groups, heads // groups, length, dim)  # query head h attends kv head h // (H / KV)
    bounds = [(a, min(a + chunk, length)) for a in range(0, length, chunk)]

    def scores(qc: mx.array, k: mx.array, a: int, b: int) -> mx.array:
        """A chunk's masked scores in float32, in base 2 (scale q k^T log2 e: softmax's exp is then 2^x, as in
        FlashAttention; MLX's CPU takes 2^x in half exp's time): rows a..b against keys 0..b."""
        s = ((qc * (scale * LOG2_E)) @ k[..., :b, :].swapaxes(-1, -2)).astype(mx.float32)
        allowed = mx.arange(a, b)[:, None] >= mx.arange(b)[None]
        return mx.where(allowed, s, -mx.inf)

    @mx.custom_function
    def attend(q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        outs, sums = [], []
        for a, b in bounds:
            qc = q[..., a:b, :] if not outs else mx.depends(q[..., a:b, :], [outs[-1]])
            s = scores(qc, k, a, b)
            # One power a score (logsumexp then 2^(s - lse) would take two: on the CPU, most of the forward's
            # time); each row's first key is unmasked, so its max is finite.
            top = s.max(axis=-1, keepdims=True)
            e = mx.power(2.0, s - top)
            total = e.sum(axis=-1, keepdims=True)
            outs.append(((e.astype(v.dtype) @ v[..., :b, :]) / total).astype(v.dtype))
            sums.append(top + mx.log2(total))
        return mx.concatenate(outs, axis=-2), mx.concatenate(sums, axis=-2)

    @attend.vjp
    def attend_backward(primals: Any, cotangents: Any, outputs: Any) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = primals
        do, (o, lse) = cotangents[0], outputs
        delta = (do.astype(mx.float32) * o.astype(mx.float32)).sum(axis=-1, keepdims=True)
        dq = []
        dk = mx.zeros(k.shape, dtype=mx.float32)
        dv = mx.zeros(v.shape, dtype=mx.float32)
        for a, b in bounds:
            qc = q[..., a:b, :] if not dq else mx.depends(q[..., a:b, :], [dq[-1], dk, dv])
            doc = do[..., a:b, :]
            p = mx.power(2.0, scores(qc, k, a, b) - lse[..., a:b, :])
            dp = (doc @ v[..., :b, :].swapaxes(-1, -2)).astype(mx.float32)
            ds = (p * (dp - delta[..., a:b, :])).astype(q.dtype)
            dq.append((ds @ k[..., :b, :]) * scale)
            pad = [(0, 0)] * 3 + [(0, length - b), (0, 0)]
            dv = dv + mx.pad((p.astype(do.dtype).swapaxes(-1, -2) @ doc).sum(axis=2, keepdims=True), pad)
            dk = dk + mx.pad((ds.swapaxes(-1, -2) @ (qc * scale)).sum(axis=2, keepdims=True), pad)
        return mx.concatenate(dq, axis=-2), dk.astype(k.dtype), dv.astype(v.dtype)

    out = attend(q.reshape(shape), k[:, :, None], v[:, :, None])[0]
    return out.reshape(batch, heads, length, dim)


@dataclass(frozen=True)
class ChunkedAttention:
    """mlx-lm's `scaled_dot_product_attention` (`fallback`), with causal self-attention of long rows chunked.

    Takes the chunked path for causal self-attention of at least ATTENTION_CHUNKED_FROM tokens
    (training and evaluation rows) and hands everything else (masks of packed rows, caches, attention
    sinks, short rows) to mlx-lm's own.
    """

    fallback: Callable[..., mx.array]
    chunk: int = ATTENTION_CHUNK
    from_tokens: int = ATTENTION_CHUNKED_FROM

    def chunks(self, queries: mx.array, keys: mx.array, cache: Any, mask: Any, sinks: Any) -> bool:
        """Whether a call takes the chunked path: causal self-attention of from_tokens or more, no sinks,
        no quantized cache."""
        length = queries.shape[2]
        return (isinstance(mask, str) and mask == "causal" and sinks is None and not hasattr(cache, "bits")
                and keys.shape[2] == length and length >= self.from_tokens)

    def __call__(self, queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
                 sinks: Any = None) -> mx.array:
        if self.chunks(queries, keys, cache, mask, sinks):
            return causal_attention(queries, keys, values, scale, self.chunk)
        return self.fallback(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install_chunked_attention() -> int:
    """Point every loaded mlx-lm model module's attention at a ChunkedAttention; returns how many.

    Called after the model is loaded, so its module is imported."""
    from mlx_lm.models import base

    stock = base.scaled_dot_product_attention
    return replace_in_models("scaled_dot_product_attention", ChunkedAttention(stock), lambda f: f is stock)


def uninstall_chunked_attention() -> None:
    """Undo `install_chunked_attention` (mlx-lm's attention everywhere again)."""
    from mlx_lm.models import base

    replace_in_models("scaled_dot_product_attention", base.scaled_dot_product_attention,
                      lambda f: isinstance(f, ChunkedAttention))
