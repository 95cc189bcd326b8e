"""Gradient reduction across data-parallel ranks, after the backward or overlapped with it.

The update must equal one process's update on the whole global batch: gradients of
the summed token losses are summed over ranks and divided by the global token count.
Gradients travel in buckets of about `bucket_mb` (one all_sum per bucket, small arrays
concatenated). `after_backward` reduces the buckets in model order once everything
is computed, as stock mlx-lm does. `overlap` orders buckets from the last layer back:
the last layers' gradients exist first in the backward, so each bucket's all_sum
depends only on work already done. Whether that hides time is a measurement
(`meshtune bench scaling`), not an assumption.

`overlap` also puts every collective of the step on a stream of its own, so a
bucket's all_sum runs (a GPU stream, or a CPU stream's own thread) while the backward
of earlier layers still computes. Every collective of a step goes on that one stream:
with the token count's all_sum left on the default stream, ranks took the two
streams' all_sums in different orders and paired wrong buffers (seen as wrong sums on
the ring backend, MLX 0.32.4). MESHTUNE_COMM_STREAM=0 keeps overlap on the default
stream (reverse bucket order only).
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..mesh import Mesh

SYNC_MODES = ("after_backward", "overlap")


def buckets(sizes: list[int], bucket_bytes: int, itemsize: int) -> list[list[int]]:
    """Consecutive index groups whose bytes reach `bucket_bytes` (the last may be smaller)."""
    groups: list[list[int]] = [[]]
    filled = 0
    for i, n in enumerate(sizes):
        groups[-1].append(i)
        filled += n * itemsize
        if filled >= bucket_bytes:
            groups.append([])
            filled = 0
    return [g for g in groups if g]


_comm_streams: dict[Any, Any] = {}


def comm_stream(mode: str, backend: str = "") -> Any:
    """The stream `mode`'s collectives run on: one of their own for overlap, else None (the default).

    NCCL reduces on the GPU, so its stream is a GPU one; the ring, JACCL and MPI
    backends reduce on the CPU, so theirs is a CPU stream: on a Mac the backward
    runs on the GPU while a CPU thread reduces the finished buckets (the research
    paper's consumer thread).
    """
    if mode != "overlap" or os.environ.get("MESHTUNE_COMM_STREAM", "1") == "0":
        return None
    device = mx.gpu if backend == "nccl" and mx.default_device().type == mx.DeviceType.gpu else mx.cpu
    key = str(device)
    if key not in _comm_streams:
        _comm_streams[key] = mx.new_stream(device)
    return _comm_streams[key]


def _sum_bucket(arrays: list[mx.array], mesh: Mesh, stream: Any = None) -> list[mx.array]:
    flat = mx.concatenate([a.reshape(-1) for a in arrays]) if len(arrays) > 1 else arrays[0].reshape(-1)
    total = mx.distributed.all_sum(flat, group=mesh.group, stream=stream)
    out, start = [], 0
    for a in arrays:
        out.append(total[start:start + a.size].reshape(a.shape))
        start += a.size
    return out


def sum_tokens(tokens: mx.array, mesh: Mesh, *, mode: str = "after_backward") -> mx.array:
    """The global token count, on the same stream as `mode`'s gradient buckets.

    Every collective of a step must run on one stream: two streams could take their
    all_sums in a different order on different ranks and pair the wrong buffers.
    """
    if mesh.world_size == 1:
        return tokens
    return mx.distributed.all_sum(tokens, group=mesh.group, stream=comm_stream(mode, mesh.backend))


def sum_gradients(grads: Any, mesh: Mesh, *, mode: str = "after_backward", bucket_mb: float = 25.0) -> Any:
    """The sum over ranks of a gradient tree, bucketed as `mode` says; identity on one rank."""
    if mesh.world_size == 1:
        return grads
    if mode not in SYNC_MODES:
        raise ValueError(f"parallel.grad_sync={mode!r} is not one of {', '.join(SYNC_MODES)}")
    flat = tree_flatten(grads)
    order = list(range(len(flat)))
    if mode == "overlap":
        order.reverse()  # the backward produces the last layers' gradients first
    stream = comm_stream(mode, mesh.backend)
    summed: dict[int, mx.array] = {}
    by_dtype: dict[Any, list[int]] = {}
    for i in order:
        by_dtype.setdefault(flat[i][1].dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        for group in buckets([flat[i][1].size for i in idx], int(bucket_mb * 2**20), dtype.size):
            members = [idx[g] for g in group]
            for i, arr in zip(members, _sum_bucket([flat[i][1] for i in members], mesh, stream)):
                summed[i] = arr
    return tree_unflatten([(flat[i][0], summed[i]) for i in range(len(flat))])


def start_gradient_sums(grads: Any, tokens: mx.array, mesh: Mesh, *, bucket_mb: float = 25.0) -> tuple[Any, mx.array]:
    """Overlap proper: each bucket's all_sum is started as soon as it is built, last layers first.

    Called outside any compiled graph on gradients that are not yet computed.
    `mx.async_eval` on a bucket's sum enqueues the backward work its gradients need,
    then the all_sum on the comm stream; the next bucket's backward then computes on
    the default stream while that all_sum is on the wire. (Inside one compiled step
    MLX orders the evaluation itself, and the first output, the embedding's
    gradient, needs the whole backward: no all_sum started early, measured 1.0x.)
    The order of all_sums is the same on every rank: this loop's.
    """
    stream = comm_stream("overlap", mesh.backend)
    with mx.stream(stream or mx.default_stream(mx.default_device())):
        total_tokens = mx.distributed.all_sum(tokens, group=mesh.group)
    mx.async_eval(total_tokens)
    flat = tree_flatten(grads)
    summed: dict[int, mx.array] = {}
    run: list[int] = []  # consecutive same-dtype leaves, last layer first
    order = list(reversed(range(len(flat))))
    for pos, i in enumerate(order):
        run.append(i)
        nxt = order[pos + 1] if pos + 1 < len(order) else None
        if nxt is not None and flat[nxt][1].dtype == flat[i][1].dtype:
            continue
        dtype = flat[i][1].dtype
        for group in buckets([flat[j][1].size for j in run], int(bucket_mb * 2**20), dtype.size):
            members = [run[g] for g in group]
            parts = _sum_bucket([flat[j][1] for j in members], mesh, stream)
            mx.async_eval(parts)
            summed.update(zip(members, parts))
        run = []
    return tree_unflatten([(flat[i][0], summed[i]) for i in range(len(flat))]), total_tokens
