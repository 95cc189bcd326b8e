"""Gradient sums over the data-parallel ranks, in buckets: after the backward or overlapped with it.

The update must equal one process's on the whole global batch: gradients of the summed token losses
are summed over ranks and divided by the global token count. Gradients travel in buckets of about
`bucket_mb` (one all_sum per bucket). `after_backward` reduces them in model order once everything is
computed, as stock mlx-lm does. `overlap` orders buckets from the last layer back and puts every
collective on one stream of its own (split over two, ranks took the all_sums in different orders and
paired wrong buffers), so a bucket's all_sum runs while earlier layers' backward computes. With
`transport: sockets` the buckets go to the socket ring's threads (socket_ring.py) and `TimedPump`
measures the exposed communication.
"""

from __future__ import annotations

import functools
import queue
import re
import threading
import time
from typing import Any, Iterator

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..runtime.cuda import on_cuda
from ..runtime.mesh import Mesh
from ..training.strategy import WaitClock
from .pack_kernel import pack_cuda


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


# Submodules of an mlx-lm block in the order its forward uses them; the backward
# produces their gradients in the reverse order.
FORWARD_ORDER = ("input_layernorm", "attention_norm", "ln_1", "self_attn", "attention", "attn", "q_proj", "k_proj",
                 "v_proj", "o_proj", "q_norm", "k_norm", "post_attention_layernorm", "ffn_norm", "ln_2",
                 "pre_feedforward_layernorm", "mlp", "feed_forward", "block_sparse_moe", "gate", "switch_mlp",
                 "gate_proj", "up_proj", "down_proj", "post_feedforward_layernorm")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def backward_order(names: list[str]) -> list[int]:
    """Indices of parameter `names` (tree_flatten order) in the order the backward produces them.

    Later blocks first; within a block the reverse of its forward (MLP before attention,
    a block's input norm last); what precedes the blocks in the tree (the embedding)
    comes last, what follows them (final norm, head) first. Reversing the tree order
    alone would put a block's input norm, whose gradient comes last, in its first bucket.
    """
    first = next((i for i, n in enumerate(names) if _LAYER.search(n)), len(names))

    def key(i: int) -> tuple:
        name = names[i]
        found = _LAYER.search(name)
        block = int(found.group(1)) if found else (-1 if i < first else 1 << 30)
        parts = name.split(".")
        within = tuple(FORWARD_ORDER.index(p) for p in parts if p in FORWARD_ORDER)
        return block, within, i

    return sorted(range(len(names)), key=key, reverse=True)


def comm_stream(mode: str, backend: str = "") -> Any:
    """The stream `mode`'s collectives run on: one of their own for overlap, else None (the default).

    NCCL reduces on the GPU, so its stream is a GPU one; the ring, JACCL and MPI
    backends reduce on the CPU, so theirs is a CPU stream: on a Mac the backward
    runs on the GPU while a CPU thread reduces the finished buckets.
    """
    if mode != "overlap":
        return None
    return _collective_stream(backend == "nccl" and mx.default_device().type == mx.DeviceType.gpu)


@functools.cache
def _collective_stream(on_gpu: bool) -> Any:
    """The process's one collective stream on the GPU or the CPU: a resource of the process, as the device
    is, not run state. Made once and kept, since MLX never frees a stream and every step's overlapped
    sums, a step in flight's and the next's alike, must keep to one stream (see above)."""
    return mx.new_stream(mx.gpu if on_gpu else mx.cpu)


def _bucket_groups(flat: list[tuple[str, mx.array]], mode: str, bucket_mb: float,
                   wire: mx.Dtype | None = None) -> list[list[int]]:
    """Indices of `flat` in buckets of about `bucket_mb`, in `mode`'s order, one dtype per bucket.

    `wire` is the one dtype every array travels in (the socket ring's float32); None
    keeps each array's own, so arrays of different dtypes never share a bucket.
    """
    if mode not in SYNC_MODES:
        raise ValueError(f"parallel.grad_sync={mode!r} is not one of {', '.join(SYNC_MODES)}")
    order = list(range(len(flat)))
    if mode == "overlap":
        order = backward_order([k for k, _ in flat])  # first computed, first summed
    by_dtype: dict[Any, list[int]] = {}
    for i in order:
        by_dtype.setdefault(wire or flat[i][1].dtype, []).append(i)
    return [[idx[g] for g in group] for dtype, idx in by_dtype.items()
            for group in buckets([flat[i][1].size for i in idx], int(bucket_mb * 2**20), dtype.size)]


def _unpack(total: mx.array, arrays: list[mx.array]) -> list[mx.array]:
    """A bucket's flat sum cut back into `arrays`' shapes and dtypes."""
    out, start = [], 0
    for a in arrays:
        part = total[start:start + a.size].reshape(a.shape)
        out.append(part if part.dtype == a.dtype else part.astype(a.dtype))
        start += a.size
    return out


def _pack(arrays: list[mx.array], dtype: mx.Dtype | None = None) -> mx.array:
    if on_cuda():
        return pack_cuda(arrays, dtype or arrays[0].dtype)  # one kernel, not a copy kernel per array
    flat = [a.reshape(-1) if dtype is None else a.reshape(-1).astype(dtype) for a in arrays]
    return mx.concatenate(flat) if len(flat) > 1 else flat[0]


def sum_gradients(grads: Any, mesh: Mesh, *, mode: str = "after_backward", bucket_mb: float = 25.0) -> Any:
    """The sum over ranks of a gradient tree, bucketed as `mode` says; identity on one rank.

    The order of all_sums is this loop's, the same on every rank; inside the compiled step
    MLX schedules each one as soon as its bucket's gradients exist.
    """
    if mesh.world_size == 1:
        return grads
    flat = tree_flatten(grads)
    stream = comm_stream(mode, mesh.backend)
    summed: dict[int, mx.array] = {}
    for members in _bucket_groups(flat, mode, bucket_mb):
        arrays = [flat[i][1] for i in members]
        parts = _unpack(mx.distributed.all_sum(_pack(arrays), group=mesh.group, stream=stream), arrays)
        summed.update(zip(members, parts))
    return tree_unflatten([(flat[i][0], summed[i]) for i in range(len(flat))])


def _sum_over_sockets(grads: Any, pump: Any, mode: str, bucket_mb: float) -> Any:
    """sum_gradients with the buckets summed by the socket ring (socket_ring.py).

    Buckets are built in `mode`'s order, each started (`mx.async_eval`) and handed to
    the ring's threads, which wait for it to be computed (MLX's wait releases the GIL)
    and send it: with `overlap` the last layers' sums travel while earlier layers
    still compute. Buckets travel as float32 and come back in their own dtypes.
    """
    flat = tree_flatten(grads)
    groups = _bucket_groups(flat, mode, bucket_mb, wire=mx.float32)
    bucketed = [_pack([flat[i][1] for i in members], mx.float32) for members in groups]
    if mode == "after_backward":
        # After the whole backward, as the mode says. Handed over lazily, a bucket needs
        # only its own weight gradients beyond the activations' backward, so the first
        # sends would overlap the rest of the weight-gradient products: a partial overlap
        # passed off as none.
        mx.eval(bucketed)
    for k, bucket in enumerate(bucketed):
        # Started here, waited for on the ring's thread: MLX throttles how much work may
        # be queued, so a loop that started every bucket before handing any over
        # would hand the first one over only after several more were computed.
        mx.async_eval(bucket)
        pump.submit(k, bucket)
    summed: dict[int, mx.array] = {}
    for k, total in pump.collect(len(groups)):  # copied back while later buckets travel
        arrays = [flat[i][1] for i in groups[k]]
        summed.update(zip(groups[k], _unpack(mx.array(total), arrays)))
    return tree_unflatten([(flat[i][0], summed[i]) for i in range(len(flat))])


class TimedPump:
    """A BucketPump whose step adds its exposed communication to a WaitClock.

    A watcher thread waits for each submitted bucket to be computed (as the pump's own
    threads do, releasing the GIL) and notes when; `collect` adds, once the last sum is
    back, the time since the last bucket was ready: the wait the sums add after compute.
    """

    def __init__(self, pump: Any, clock: WaitClock) -> None:
        self.pump, self.clock = pump, clock
        self._watch: queue.Queue = queue.Queue()
        self._ready: queue.Queue = queue.Queue()
        threading.Thread(target=self._watcher, daemon=True, name="meshtune-bucket-watch").start()

    def _watcher(self) -> None:
        while True:
            bucket = self._watch.get()
            try:
                np.asarray(bucket)  # waits for an mx.array already started (mx.async_eval)
            except Exception:  # the pump's own threads raise it on the training thread
                pass
            self._ready.put(time.perf_counter())

    def submit(self, key: Any, buf: Any) -> None:
        self._watch.put(buf)
        self.pump.submit(key, buf)

    def collect(self, count: int) -> Iterator[tuple[Any, np.ndarray]]:
        yield from self.pump.collect(count)
        done = time.perf_counter()
        self.clock.add(done - max(self._ready.get() for _ in range(count)))


def sum_for_update(grads: Any, tokens: mx.array, mesh: Mesh, *, mode: str = "after_backward",
                   bucket_mb: float = 25.0, pump: Any = None) -> tuple[Any, mx.array]:
    """Gradients and the step's token count summed over ranks, in the same buckets.

    The count rides in the buckets as float32 (one all_sum fewer per step, which is
    latency on a slow link; all of a step's collectives also stay on one stream, see
    above). It only divides the gradients, so float32's rounding above 2^24 tokens a
    step (6e-8 relative) is harmless. With a socket ring's `pump` the buckets go over
    its sockets instead of the backend's all_sum.
    """
    if mesh.world_size == 1:
        return grads, tokens
    tree = {"grads": grads, "tokens": tokens.astype(mx.float32)}
    if pump is not None:
        summed = _sum_over_sockets(tree, pump, mode, bucket_mb)
    else:
        summed = sum_gradients(tree, mesh, mode=mode, bucket_mb=bucket_mb)
    return summed["grads"], summed["tokens"]
