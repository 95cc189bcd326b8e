"""The data-parallel training step: a compiled backward (and the gradient sums), then the update.

`build_step` is the step `meshtune train` runs: each micro-batch but the last is `accumulate`d,
the last `finish`es with the sums over the ranks (gradient_sums.py) and the update gated on the
global gradient norm (training/update.py), the backward dispatched before the update is built
on it. `build_sampled_step` runs the same step split, its sums evaluated and timed alone: one
step per report window on the mlx transport, where the sums inside the compiled step are
invisible to a host clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_map

from ..adapters import StepContext
from ..runtime.mesh import Mesh
from ..training.model_loss import training_loss_terms
from ..training.strategy import WaitClock
from ..training.update import StepVerdict, apply_update
from .gradient_sums import TimedPump, sum_for_update
from .socket_ring import BucketPump, SocketRing, hostfile_links


def _step_parts(model: nn.Module, optimizer: optim.Optimizer, *, max_grad_norm: float, compile: bool,
                step_context: StepContext | None) -> tuple[Callable, Callable, Callable]:
    """(backward, apply, compiled): a step's two halves, and what compiles a function over the step's state.
    The backward runs inside `step_context` (the adapters' per-step work; default: the config's defaults)."""
    step_context = step_context or StepContext()
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
               transport: str = "mlx", clock: WaitClock | None = None,
               step_context: StepContext | None = None) -> Step:
    """The step `meshtune train` runs (see Step), compiled with `compile`, its forward and backward inside
    `step_context` (the run's adapters' per-step work, adapters/per_step.py).

    On the socket transport the backward and the update are compiled apart and the
    gradient buckets go to the socket ring's threads between them as they come due
    (sum_for_update with a pump); `clock` gets each step's exposed communication (TimedPump).
    """
    backward, apply, compiled = _step_parts(model, optimizer, max_grad_norm=max_grad_norm, compile=compile,
                                            step_context=step_context)
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
                       compile: bool, sync: str = "after_backward", bucket_mb: float = 25.0,
                       step_context: StepContext | None = None
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
    backward, apply, compiled = _step_parts(model, optimizer, max_grad_norm=max_grad_norm, compile=compile,
                                            step_context=step_context)
    backward, apply = compiled(backward), compiled(apply)

    def sampled(tokens: mx.array, lengths: mx.array, acc_grads: Any, acc_tokens: Any):
        ce, n, grads, total = backward(tokens, lengths, acc_grads, acc_tokens)
        mx.eval(ce, n, grads, total)
        tic = time.perf_counter()
        summed = sum_for_update(grads, total, mesh, mode=sync, bucket_mb=bucket_mb)
        mx.eval(summed)
        return (ce, n, StepVerdict(*apply(*summed))), time.perf_counter() - tic

    return sampled
