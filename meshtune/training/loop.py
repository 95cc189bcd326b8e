"""The training loop: a compiled step, periodic eval, reports and saves, top to bottom.

One optimizer step consumes `grad_accumulation_steps` micro-batches. Gradients are
taken of the summed token losses and divided by the token count of the whole global
batch (all micro-batches, all data-parallel ranks), so the update equals the one a
single process would make on the same global batch; reported losses are weighted by
tokens the same way. Each micro-batch is one compiled call and one `mx.eval`; the
allocator cache is left alone (clearing it every step, as stock mlx-lm does, costs
time and buys nothing at a steady shape mix).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Iterator

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_map

from ..adapters.step_norms import step_row_norms
from .checkpoint import TrainingState
from .losses import masked_ce_sum
from ..parallel.mesh import Mesh
from ..parallel.data_parallel import split_overlap, sum_for_update
from ..parallel.socket_ring import BucketPump, SocketRing, hostfile_ips
from .metrics import Reporter, Window


def loss_terms(model: nn.Module, tokens: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
    """(sum of target-token cross entropy, number of target tokens) for one batch."""
    return masked_ce_sum(model(tokens[:, :-1]), tokens[:, 1:], lengths)


class OneInFlight:
    """Evaluates a loop's outputs one iteration behind where `overlap` (runtime.overlap_steps):
    `run` dispatches this iteration's outputs, then waits for the previous iteration's `wait_on`
    arrays, so the host builds the next iteration while the device runs this one. MLX signals an
    evaluation's arrays together, at its end, so waiting on a few of them waits for all of it.
    Without `overlap`, `run` evaluates and returns."""

    def __init__(self, overlap: bool):
        self.overlap = overlap
        self._pending: list[mx.array] = []

    def run(self, outputs: Any, wait_on: list[mx.array]) -> None:
        if not self.overlap:
            mx.eval(outputs)
            return
        mx.async_eval(outputs)
        self.finish()
        self._pending = list(wait_on)

    def finish(self) -> None:
        """Wait for the iteration still in flight, if any."""
        mx.eval(self._pending)
        self._pending = []


def evaluate(model: nn.Module, batches: Iterable[Any], mesh: Mesh,
             beat: Callable[[], None] = lambda: None, counts: bool = True,
             overlap: bool = False) -> tuple[float, int]:
    """Token-weighted loss over `batches` on every rank: (loss, global tokens).

    A rank with `counts` false computes but adds nothing (a pipeline stage whose
    replica's first stage already counts the same batches). With `overlap`
    (runtime.overlap_steps) each batch is dispatched before the previous one is waited for.
    """
    model.eval()
    total, tokens = mx.array(0.0), mx.array(0)
    in_flight = OneInFlight(overlap)
    for batch in batches:
        ce, n = loss_terms(model, batch.tokens, batch.lengths)
        total, tokens = total + ce, tokens + n
        in_flight.run([total, tokens], [total, tokens])
        beat()
    in_flight.finish()
    model.train()
    if not counts:
        total, tokens = mx.zeros_like(total), mx.zeros_like(tokens)
    total, tokens = mesh.all_sum(total), mesh.all_sum(tokens)
    n = int(tokens.item())
    return (total.item() / n if n else float("nan")), n


def enable_grad_checkpoint(block: nn.Module) -> None:
    """Recompute every block of this type in the backward pass instead of storing activations."""
    fn = type(block).__call__

    def checkpointed(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        def inner(params: Any, *a: Any, **kw: Any) -> Any:
            module.update(params)
            return fn(module, *a, **kw)

        return mx.checkpoint(inner)(module.trainable_parameters(), *args, **kwargs)

    checkpointed.recomputes_in_backward = True  # adapters/step_norms.py asks
    type(block).__call__ = checkpointed


def build_step(model: nn.Module, optimizer: optim.Optimizer, mesh: Mesh, *, max_grad_norm: float,
               compile: bool, sync: str = "after_backward",
               bucket_mb: float = 25.0, transport: str = "mlx") -> Callable[..., tuple[mx.array, mx.array, Any, Any]]:
    """step(tokens, lengths, grads, ntoks, update) -> (loss_sum, ntoks_batch, grads, ntoks)."""
    loss_and_grad = nn.value_and_grad(model, loss_terms)
    state = [model.state, optimizer.state, mx.random.state]
    compiled = partial(mx.compile, inputs=state, outputs=state) if compile else (lambda f: f)

    def backward(tokens: mx.array, lengths: mx.array, acc_grads: Any, acc_tokens: Any):
        # DoRA's row norms for the whole step first (a few launches on CUDA, none elsewhere).
        with step_row_norms(model, tokens[:, :-1].size):
            (ce, n), grads = loss_and_grad(model, tokens, lengths)
        if acc_grads is not None:
            grads = tree_map(mx.add, grads, acc_grads)
        return ce, n, grads, n if acc_tokens is None else acc_tokens + n

    def apply(grads: Any, tokens: mx.array) -> None:
        """The update from gradients and token count already summed over the ranks."""
        grads = tree_map(lambda g: g / tokens.astype(g.dtype), grads)
        if max_grad_norm > 0:
            grads, _ = optim.clip_grad_norm(grads, max_grad_norm)
        optimizer.update(model, grads)

    sockets = transport == "sockets" and mesh.world_size > 1
    split = mesh.world_size > 1 and (sockets or (sync == "overlap" and split_overlap()))
    if split:
        # Compiled backward and update; between them each bucket's sum is started as its
        # gradients come due: an all_sum (data_parallel.sum_gradients, start=True) or a
        # hand-over to the socket ring's threads (data_parallel.sum_for_update with a pump).
        backward, apply = compiled(backward), compiled(apply)
    pump = BucketPump(SocketRing(mesh.rank, hostfile_ips(), mesh.all_ints)) if sockets else None

    def step(tokens: mx.array, lengths: mx.array, acc_grads: Any, acc_tokens: Any, update: bool):
        ce, n, grads, total = backward(tokens, lengths, acc_grads, acc_tokens)
        if not update:
            return ce, n, grads, total
        apply(*sum_for_update(grads, total, mesh, mode=sync, bucket_mb=bucket_mb, start=split, pump=pump))
        return ce, n, None, None

    return step if split else compiled(step)


AGREE_EVERY = 8  # steps between the ranks' agreements on a stop request


@dataclass(kw_only=True)
class LoopSettings:
    """The loop's knobs, taken from the train config."""

    iters: int
    grad_accumulation_steps: int
    steps_per_report: int
    steps_per_eval: int
    save_every: int
    max_grad_norm: float = 0.0
    compile: bool = True
    grad_sync: str = "after_backward"
    bucket_mb: float = 25.0
    transport: str = "mlx"
    overlap_steps: bool = False


def overlaps_steps(setting: bool | str) -> bool:
    """runtime.overlap_steps as the loop takes it: "auto" is on where arrays live on a GPU."""
    if setting == "auto":
        return mx.default_device().type == mx.DeviceType.gpu
    return setting is True


@dataclass(kw_only=True)
class LoopResult:
    step: int
    train_loss: float | None
    val_loss: float | None
    trained_tokens: int
    stopped_early: bool


class _StopFlag:
    """Turns SIGTERM/SIGINT into a request to save and stop at the next step."""

    def __init__(self) -> None:
        self.requested = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_StopFlag":
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # a second signal means "now"
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def step_seed(seed: int, step: int) -> int:
    """The RNG seed of one optimizer step: a resumed run draws the same dropout masks."""
    return (seed * 1_000_003 + step) % 2**63


def train(model: nn.Module, optimizer: optim.Optimizer, batches: Iterator[Any], *,
          settings: LoopSettings, seed: int, mesh: Mesh, reporter: Reporter, start: TrainingState,
          validate: Callable[[], tuple[float, int]] | None,
          save: Callable[[TrainingState], None], cursor: Callable[[], dict[str, Any]],
          beat: Callable[[int], None] = lambda step: None,
          pipeline: Callable[[Any], tuple[mx.array, mx.array]] | None = None) -> LoopResult:
    """Run optimizer steps start.step+1 .. settings.iters; eval, report and save on schedule.

    `pipeline(batch) -> (loss sum, tokens)` replaces the compiled step on a pipeline
    stage (it updates the stage's weights itself); only one stage should return
    non-zero sums, since reports add them over all ranks.
    """
    step_fn = None if pipeline is not None else build_step(
        model, optimizer, mesh, max_grad_norm=settings.max_grad_norm, compile=settings.compile,
        sync=settings.grad_sync, bucket_mb=settings.bucket_mb, transport=settings.transport)
    model.train()
    window, trained_tokens = Window(), start.trained_tokens
    train_loss = val_loss = None
    step = start.step
    # The wait is on a micro-batch's own loss arrays: the state's containers are updated in
    # place, so by then they hold the next micro-batch's arrays.
    in_flight = OneInFlight(settings.overlap_steps)

    def run_eval(at: int) -> float:
        tic = time.perf_counter()
        loss, n = validate()
        reporter.eval(at, split="val", loss=loss, tokens=n, seconds=time.perf_counter() - tic)
        return loss

    if validate is not None and step == 0:
        val_loss = run_eval(0)
    with _StopFlag() as stop:
        while step < settings.iters:
            tic = time.perf_counter()
            mx.random.seed(step_seed(seed, step))
            grads = ntoks = None
            for micro in range(settings.grad_accumulation_steps):
                batch = next(batches)
                if pipeline is not None:  # the stage runs its schedule; micro-batches live inside it
                    window.add(*pipeline(batch))
                    mx.eval(window.loss_sum, window.tokens)
                    continue
                last = micro == settings.grad_accumulation_steps - 1
                ce, n, grads, ntoks = step_fn(batch.tokens, batch.lengths, grads, ntoks, last)
                window.add(ce, n)
                in_flight.run([model.state, optimizer.state, mx.random.state, window.loss_sum, window.tokens,
                               grads, ntoks], [window.loss_sum, window.tokens])
            window.end_step(time.perf_counter() - tic)
            step += 1
            beat(step)
            reporter.advance()

            if step % settings.steps_per_report == 0 or step == settings.iters:
                loss_sum, tokens = mesh.all_sum(window.loss_sum), mesh.all_sum(window.tokens)
                tokens_n = int(tokens.item())
                train_loss = loss_sum.item() / max(tokens_n, 1)
                trained_tokens += tokens_n
                reporter.train(step, loss=train_loss, tokens=tokens_n, seconds=window.seconds,
                               steps=window.steps, learning_rate=float(optimizer.learning_rate),
                               trained_tokens=trained_tokens)
                window = Window()
            if validate is not None and (step % settings.steps_per_eval == 0 or step == settings.iters):
                val_loss = run_eval(step)
            # A stop request (SIGTERM/SIGINT on any rank) is agreed every few steps, not
            # every step: each agreement is one more round trip on the link.
            agree_now = mesh.world_size == 1 or step % AGREE_EVERY == 0 or step == settings.iters
            stopping = mesh.agree(stop.requested) if agree_now else False
            if step % settings.save_every == 0 or step == settings.iters or stopping:
                save(TrainingState(step=step, data_cursor=cursor(), trained_tokens=trained_tokens))
            if stopping:
                reporter.note("stop", step, f"stopped at step {step} on request; checkpoint saved")
                return LoopResult(step=step, train_loss=train_loss, val_loss=val_loss,
                                  trained_tokens=trained_tokens, stopped_early=True)
    return LoopResult(step=step, train_loss=train_loss, val_loss=val_loss,
                      trained_tokens=trained_tokens, stopped_early=False)
