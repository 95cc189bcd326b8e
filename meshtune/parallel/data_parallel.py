"""Data parallelism: the strategy whose ranks each hold the whole model, and its gradient sums.

`DataParallel` is the strategy (training/strategy.py) for a mesh without pipeline
stages, one process included: each rank runs the compiled step (`build_step`) on its
share of every global batch and the gradients are summed over ranks before the one
update, over MLX's collectives or meshtune's socket ring (socket_ring.py).

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
the ring backend, MLX 0.32.4).

With `transport: sockets` the step has a host-side point between compute and sums,
so reports measure the exposed communication (`TimedPump`: from the moment the last
bucket's gradients exist to the moment the last sum is back) as `comm_share`. On the
mlx transport the sums run inside the one compiled step, where no host clock sees them,
so one step per report window is sampled (`build_sampled_step`): the first step after
each report runs split, its sums evaluated and timed alone after its backward, and
every step of the window counts that sample's seconds. With `grad_sync: overlap` the
sampled sums are not overlapped, so there it is an upper bound of the exposed wait.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..adapters import ADAPTER_FILE, CONFIG_FILE, load_trainable, step_context, trainable_parameters
from ..runtime.cuda import on_cuda
from ..training.checkpoint import (LoadedCheckpoint, TrainingState, atomic_save_safetensors, load_checkpoint,
                                   resumable_checkpoint, save_checkpoint)
from ..training.evaluation import evaluate
from ..training.in_flight import OneInFlight
from ..training.model_loss import training_loss_terms
from ..training.strategy import WaitClock
from ..training.update import StepVerdict, apply_update
from ..runtime.mesh import Mesh
from .pack_kernel import pack_cuda
from .socket_ring import BucketPump, SocketRing, hostfile_links

if TYPE_CHECKING:
    from ..config import Config

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


_comm_streams: dict[Any, Any] = {}


def comm_stream(mode: str, backend: str = "") -> Any:
    """The stream `mode`'s collectives run on: one of their own for overlap, else None (the default).

    NCCL reduces on the GPU, so its stream is a GPU one; the ring, JACCL and MPI
    backends reduce on the CPU, so theirs is a CPU stream: on a Mac the backward
    runs on the GPU while a CPU thread reduces the finished buckets.
    """
    if mode != "overlap":
        return None
    device = mx.gpu if backend == "nccl" and mx.default_device().type == mx.DeviceType.gpu else mx.cpu
    key = str(device)
    if key not in _comm_streams:
        _comm_streams[key] = mx.new_stream(device)
    return _comm_streams[key]


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


def _step_parts(model: nn.Module, optimizer: optim.Optimizer, *, max_grad_norm: float, compile: bool
                ) -> tuple[Callable, Callable, Callable]:
    """(backward, apply, compiled): a step's two halves, and what compiles a function over the step's state."""
    loss_and_grad = nn.value_and_grad(model, training_loss_terms)
    state = [model.state, optimizer.state, mx.random.state]
    compiled = partial(mx.compile, inputs=state, outputs=state) if compile else (lambda f: f)

    def backward(tokens: mx.array, lengths: mx.array, acc_grads: Any, acc_tokens: Any):
        with step_context(model, tokens[:, :-1].size):  # adapters' per-step work (DoRA's norms on CUDA)
            (ce, n), grads = loss_and_grad(model, tokens, lengths)
        if acc_grads is not None:
            grads = tree_map(mx.add, grads, acc_grads)
        return ce, n, grads, n if acc_tokens is None else acc_tokens + n

    def apply(grads: Any, tokens: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The update from gradients and token count already summed over the ranks; (ok, norm, tokens)."""
        return tuple(apply_update(model, optimizer, grads, tokens, max_grad_norm=max_grad_norm).arrays())

    return backward, apply, compiled


@dataclass(frozen=True)
class Step:
    """A data-parallel step's two calls, each one micro-batch: zero or more `accumulate`, then `finish`.

    accumulate(tokens, lengths, grads, ntoks) -> (loss_sum, ntoks_batch, grads, ntoks): the
        micro-batch's gradients and target tokens added to `grads` and `ntoks` (None at a
        step's first micro-batch).
    finish(tokens, lengths, grads, ntoks) -> (loss_sum, ntoks_batch, verdict): the same, then
        the sums over the ranks and the optimizer's update unless the step is bad
        (training/update.py); `verdict` is its StepVerdict.
    """

    accumulate: Callable[..., tuple[mx.array, mx.array, Any, mx.array]]
    finish: Callable[..., tuple[mx.array, mx.array, StepVerdict]]


def _with_verdict(finish: Callable[..., tuple[mx.array, mx.array, Any]]
                  ) -> Callable[..., tuple[mx.array, mx.array, StepVerdict]]:
    def finish_step(*args: Any) -> tuple[mx.array, mx.array, StepVerdict]:
        ce, n, verdict = finish(*args)
        return ce, n, StepVerdict(*verdict)

    return finish_step


def build_step(model: nn.Module, optimizer: optim.Optimizer, mesh: Mesh, *, max_grad_norm: float,
               compile: bool, sync: str = "after_backward", bucket_mb: float = 25.0,
               transport: str = "mlx", clock: WaitClock | None = None) -> Step:
    """The step `meshtune train` runs (see Step), compiled with `compile`.

    On the socket transport the backward and the update are compiled apart and the
    gradient buckets go to the socket ring's threads between them as they come due
    (sum_for_update with a pump); `clock` gets each step's exposed communication (TimedPump).
    """
    backward, apply, compiled = _step_parts(model, optimizer, max_grad_norm=max_grad_norm, compile=compile)
    sockets = transport == "sockets" and mesh.world_size > 1
    if sockets:
        backward, apply = compiled(backward), compiled(apply)
    pump = BucketPump(SocketRing(mesh.rank, hostfile_links(), mesh.all_ints)) if sockets else None
    if pump is not None and clock is not None:
        pump = TimedPump(pump, clock)

    if sockets:
        def finish(tokens: mx.array, lengths: mx.array, acc_grads: Any, acc_tokens: Any):
            ce, n, grads, total = backward(tokens, lengths, acc_grads, acc_tokens)
            return ce, n, apply(*sum_for_update(grads, total, mesh, mode=sync, bucket_mb=bucket_mb, pump=pump))

        return Step(accumulate=backward, finish=_with_verdict(finish))

    def backward_and_sums(tokens: mx.array, lengths: mx.array, acc_grads: Any, acc_tokens: Any):
        ce, n, grads, total = backward(tokens, lengths, acc_grads, acc_tokens)
        return ce, n, *sum_for_update(grads, total, mesh, mode=sync, bucket_mb=bucket_mb)

    backward, backward_and_sums, apply = compiled(backward), compiled(backward_and_sums), compiled(apply)

    def finish_in_two_graphs(tokens: mx.array, lengths: mx.array, acc_grads: Any, acc_tokens: Any):
        # The backward (and its sums) is dispatched before the update is built on it. In one graph
        # MLX's scheduler puts off the weight gradients, which the update reads only through the
        # gate's global norm, and every one put off keeps its block's activations alive: with
        # train.grad_checkpoint every block's recomputed activations at once (rows x hidden x 5-10
        # per block, docs/performance.md's long rows). No host wait: async_eval only dispatches.
        ce, n, grads, total = backward_and_sums(tokens, lengths, acc_grads, acc_tokens)
        mx.async_eval(ce, n, grads, total)
        return ce, n, apply(grads, total)

    return Step(accumulate=backward, finish=_with_verdict(finish_in_two_graphs))


def build_sampled_step(model: nn.Module, optimizer: optim.Optimizer, mesh: Mesh, *, max_grad_norm: float,
                       compile: bool, sync: str = "after_backward", bucket_mb: float = 25.0
                       ) -> Callable[..., tuple[tuple[mx.array, mx.array, StepVerdict], float]]:
    """sampled(tokens, lengths, grads, ntoks) -> (Step.finish's outputs, comm seconds).

    A step's last micro-batch run split, for the mlx transport's comm_share: the
    compiled backward is evaluated, then the gradient sums (sum_for_update, the same
    buckets) are evaluated and timed alone (the communication wait this step exposes,
    the slowest rank's backward included), then the compiled update. The sums run
    after the whole backward, so with `overlap` the seconds are an upper bound of the
    wait the compiled step exposes. The weights equal the compiled step's within float
    rounding; the evaluations are the host syncs of this one step.
    """
    backward, apply, compiled = _step_parts(model, optimizer, max_grad_norm=max_grad_norm, compile=compile)
    backward, apply = compiled(backward), compiled(apply)

    def sampled(tokens: mx.array, lengths: mx.array, acc_grads: Any, acc_tokens: Any):
        ce, n, grads, total = backward(tokens, lengths, acc_grads, acc_tokens)
        mx.eval(ce, n, grads, total)
        tic = time.perf_counter()
        summed = sum_for_update(grads, total, mesh, mode=sync, bucket_mb=bucket_mb)
        mx.eval(summed)
        return (ce, n, StepVerdict(*apply(*summed))), time.perf_counter() - tic

    return sampled


class DataParallel:
    """The strategy of a mesh without pipeline stages: the whole model on every rank (or the one process).

    `sample_comm` (on from from_config, which the training loop's runs use): on the mlx
    transport with more than one rank, the first step after each `take_waits()` (each report
    window's first, and the run's first) runs split (build_sampled_step) and its sums'
    seconds are added to the clock once for every step until the next `take_waits()`: the
    window's comm seconds are sampled comm x steps in the window. No other step syncs the host.
    """

    def __init__(self, model: nn.Module, optimizer: optim.Optimizer, mesh: Mesh, *, accumulation: int = 1,
                 max_grad_norm: float = 0.0, compile: bool = True, sync: str = "after_backward",
                 bucket_mb: float = 25.0, transport: str = "mlx", overlap: bool = False, sample_comm: bool = False):
        self.model, self.optimizer, self.mesh = model, optimizer, mesh
        self.accumulation, self.overlap = accumulation, overlap
        sampled = sample_comm and transport == "mlx" and mesh.world_size > 1
        self.clock = WaitClock() if sampled or (transport == "sockets" and mesh.world_size > 1) else None
        # Built at the first step: the compiled step holds the optimizer's state container, which a
        # resume replaces.
        self._build = partial(build_step, model, optimizer, mesh, max_grad_norm=max_grad_norm, compile=compile,
                              sync=sync, bucket_mb=bucket_mb, transport=transport, clock=self.clock)
        self._build_sampled = partial(build_sampled_step, model, optimizer, mesh, max_grad_norm=max_grad_norm,
                                      compile=compile, sync=sync, bucket_mb=bucket_mb) if sampled else None
        self._step: Step | None = None
        self._sampled: Callable[..., Any] | None = None
        self._comm: float | None = None  # the window's sampled comm seconds; None: sample the next step
        self._in_flight = OneInFlight(overlap)

    @staticmethod
    def check(cfg: "Config", mesh: Mesh, model_path: Path) -> None:
        """Raise what this layout cannot run as `cfg` asks, before the model loads."""
        if cfg.parallel.transport == "sockets" and mesh.world_size > 1:
            hostfile_links()  # says what to change when there is no ring hostfile

    @classmethod
    def from_config(cls, cfg: "Config", mesh: Mesh, model: nn.Module, optimizer: optim.Optimizer, *,
                    overlap: bool, say: Callable[[str], None]) -> "DataParallel":
        t, p = cfg.train, cfg.parallel
        return cls(model, optimizer, mesh, accumulation=t.grad_accumulation_steps, max_grad_norm=t.max_grad_norm,
                   compile=t.compile, sync=p.grad_sync, bucket_mb=p.bucket_mb, transport=p.transport, overlap=overlap,
                   sample_comm=True)

    def step(self, batches: Iterator[Any]) -> tuple[list[tuple[mx.array, mx.array]], StepVerdict]:
        self._step = self._step or self._build()
        sample = self._build_sampled is not None and self._comm is None
        if sample:
            self._sampled = self._sampled or self._build_sampled()
        grads = tokens = None  # the step's sums so far
        losses = []
        for micro in range(self.accumulation):
            batch = next(batches)
            if micro < self.accumulation - 1:
                ce, n, grads, tokens = self._step.accumulate(batch.tokens, batch.lengths, grads, tokens)
                carried = [grads, tokens]
            elif sample:
                (ce, n, verdict), self._comm = self._sampled(batch.tokens, batch.lengths, grads, tokens)
                carried = verdict.arrays()
            else:
                ce, n, verdict = self._step.finish(batch.tokens, batch.lengths, grads, tokens)
                carried = verdict.arrays()
            losses.append((ce, n))
            # The wait is on a micro-batch's own loss arrays: the state's containers are updated
            # in place, so by then they hold the next micro-batch's arrays. The verdict is
            # evaluated with the last call.
            self._in_flight.run([self.model.state, self.optimizer.state, mx.random.state, ce, n, *carried],
                                [ce, n])
        if self._build_sampled is not None:
            self.clock.add(self._comm)
        return losses, verdict

    def take_waits(self) -> dict[str, float]:
        self._comm = None  # the next window samples its own first step
        return {} if self.clock is None else {"comm": self.clock.take()}

    def evaluate(self, batches: Iterable[Any], beat: Callable[[], None] = lambda: None) -> tuple[float, int]:
        return evaluate(self.model, batches, self.mesh, beat=beat, overlap=self.overlap)

    def write_weights(self, path: Path) -> None:
        if self.mesh.is_writer:
            atomic_save_safetensors(path, trainable_parameters(self.model))

    def save(self, out: Path, state: TrainingState, *, config: dict[str, Any], keep: int) -> None:
        if self.mesh.is_writer:
            save_checkpoint(out, state=state, trainable=trainable_parameters(self.model),
                            optimizer_state=self.optimizer.state, config=config, keep=keep,
                            alongside=(out / CONFIG_FILE,))

    def latest_checkpoint(self, out: Path, say: Callable[[str], None]) -> LoadedCheckpoint | None:
        path = resumable_checkpoint(out, say)
        return None if path is None else load_checkpoint(path)

    def restore(self, ckpt: LoadedCheckpoint) -> None:
        single = ckpt.path / ADAPTER_FILE  # absent from a pipeline's checkpoint: its stages' shards are merged
        load_trainable(self.model, single if single.exists() else ckpt.path, ckpt.trainable)
        self.optimizer.state = ckpt.optimizer_state
        self.optimizer.init(self.model.trainable_parameters())
