"""Chunked causal attention (training/attention.py): mlx's attention's values and gradients, memory linear in the row."""

from __future__ import annotations

import mlx.core as mx
import pytest

from meshtune.training.attention import ChunkedAttention, causal_attention


def _qkv(heads, kv_heads, length, dim, dtype):
    keys = mx.random.split(mx.random.key(0), 4)
    q = mx.random.normal((2, heads, length, dim), key=keys[0]).astype(dtype)
    k = mx.random.normal((2, kv_heads, length, dim), key=keys[1]).astype(dtype)
    v = mx.random.normal((2, kv_heads, length, dim), key=keys[2]).astype(dtype)
    w = mx.random.normal((2, heads, length, dim), key=keys[3]).astype(dtype)
    return q, k, v, w


@pytest.mark.parametrize("dtype, tol", [(mx.float32, 1e-5), (mx.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_values_and_gradients_are_mlx_attentions(dtype, tol, heads, kv_heads):
    q, k, v, w = _qkv(heads, kv_heads, 300, 16, dtype)  # 300 rows: a ragged last chunk of 64
    scale = 16 ** -0.5

    def ref(q, k, v):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")

    def mine(q, k, v):
        return causal_attention(q, k, v, scale, chunk=64)

    assert mx.abs(ref(q, k, v) - mine(q, k, v)).max().item() < tol * 10
    loss = lambda f: lambda q, k, v: (f(q, k, v).astype(mx.float32) * w).sum()  # noqa: E731
    for a, b in zip(mx.grad(loss(ref), argnums=(0, 1, 2))(q, k, v), mx.grad(loss(mine), argnums=(0, 1, 2))(q, k, v)):
        assert (mx.abs(a - b).max() / mx.abs(a).max()).item() < tol


def test_only_long_causal_self_attention_is_chunked():
    stock = []
    chunked = ChunkedAttention(lambda q, *a, **kw: stock.append(q.shape[2]) or q, chunk=64, from_tokens=128)
    q, k, v, _ = _qkv(2, 2, 128, 8, mx.float32)
    assert chunked.chunks(q, k, None, "causal", None)
    assert mx.allclose(chunked(q, k, v, None, 1.0, "causal"), causal_attention(q, k, v, 1.0, 64)).item()
    mask = mx.ones((128, 128), dtype=mx.bool_)  # packed rows' block-diagonal masks go to mlx
    short = _qkv(2, 2, 64, 8, mx.float32)
    for args in ((q, k, v, None, 1.0, mask), (*short[:3], None, 1.0, "causal"), (q[:, :, :1], k, v, None, 1.0, None)):
        assert not chunked.chunks(args[0], args[1], args[3], args[5], None)
        chunked(*args)
    assert stock == [128, 64, 1]  # every other call went to mlx-lm's own


def _peak_of_backward(length: int, **kw) -> int:
    q, k, v, _ = _qkv(4, 2, length, 32, mx.float32)
    grad = mx.grad(lambda q, k, v: causal_attention(q, k, v, 32 ** -0.5, **kw).sum(), argnums=(0, 1, 2))
    mx.eval(q, k, v)
    mx.reset_peak_memory()
    live = mx.get_active_memory()
    mx.eval(grad(q, k, v))
    return mx.get_peak_memory() - live


def test_memory_grows_linearly_with_the_row():
    """Twice the row, at most about twice the memory (the whole scores would be four times)."""
    small, large = _peak_of_backward(2048, chunk=256), _peak_of_backward(4096, chunk=256)
    assert large < 2.5 * small, (small, large)
    whole = 2 * 4 * 4096 * 4096 * 4  # one float32 copy of the scores, batch 2 x 4 heads
    assert large < whole / 2, (large, whole)


@pytest.mark.parametrize("longest, flags, said", [
    (100, {}, False),  # the default 2,048-token cap: short rows take mlx-lm's own attention, no word
    (2100, {}, True),  # cut to 2,048 columns: 2,047 inputs
    (1999, {"data.pad_to": 1}, False),  # 1,998 inputs
    (2100, {"data.pack": True}, False),  # a packed row's mask goes to mlx-lm's own
])
def test_a_run_says_chunked_attention_only_where_its_rows_take_it(longest, flags, said):
    """`meshtune train` notes the chunked path (on the CPU, as here) once the data's longest row is known."""
    from meshtune.api import _say_chunked_attention
    from meshtune.config import load_config

    lines: list[str] = []
    _say_chunked_attention(load_config(None, flags), longest, lines.append)
    assert bool(lines) == said and all("512 queries at a time" in line for line in lines), lines
