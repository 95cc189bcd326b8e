"""Data parallelism: the strategy whose ranks each hold the whole model (or the one process).

`DataParallel` is the strategy (training/strategy.py) for a mesh without pipeline stages: each
rank runs the compiled step (data_parallel_step.build_step) on its share of every global batch,
and the gradients are summed over the ranks before the one update (gradient_sums.py), over
MLX's collectives or meshtune's socket ring (socket_ring.py). On the mlx transport one step per
report window runs split (build_sampled_step), so the report can say what the sums cost.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from ..adapters import StepContext, load_trainable, trainable_parameters
from ..run_dir import CheckpointDir, RunDir
from ..runtime.mesh import Mesh
from ..training.checkpoint import (LoadedCheckpoint, TrainingState, atomic_save_safetensors, load_checkpoint,
                                   resumable_checkpoint, save_checkpoint)
from ..training.evaluation import evaluate
from ..training.in_flight import OneInFlight
from ..training.strategy import WaitClock
from ..training.update import StepVerdict
from .data_parallel_step import Step, build_sampled_step, build_step
from .socket_ring import hostfile_links

if TYPE_CHECKING:
    from ..config import Config


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
                 bucket_mb: float = 25.0, transport: str = "mlx", overlap: bool = False, sample_comm: bool = False,
                 step_context: StepContext | None = None):
        self.model, self.optimizer, self.mesh = model, optimizer, mesh
        self.accumulation, self.overlap = accumulation, overlap
        sampled = sample_comm and transport == "mlx" and mesh.world_size > 1
        self.clock = WaitClock() if sampled or (transport == "sockets" and mesh.world_size > 1) else None
        # Built at the first step: the compiled step holds the optimizer's state container, which a
        # resume replaces.
        self._build = partial(build_step, model, optimizer, mesh, max_grad_norm=max_grad_norm, compile=compile,
                              sync=sync, bucket_mb=bucket_mb, transport=transport, clock=self.clock,
                              step_context=step_context)
        self._build_sampled = partial(build_sampled_step, model, optimizer, mesh, max_grad_norm=max_grad_norm,
                                      compile=compile, sync=sync, bucket_mb=bucket_mb,
                                      step_context=step_context) if sampled else None
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
                    overlap: bool, say: Callable[[str], None], step_context: StepContext) -> "DataParallel":
        t, p = cfg.train, cfg.parallel
        return cls(model, optimizer, mesh, accumulation=t.grad_accumulation_steps, max_grad_norm=t.max_grad_norm,
                   compile=t.compile, sync=p.grad_sync, bucket_mb=p.bucket_mb, transport=p.transport, overlap=overlap,
                   sample_comm=True, step_context=step_context)

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
                            alongside=(RunDir(out).config,))

    def latest_checkpoint(self, out: Path, say: Callable[[str], None]) -> LoadedCheckpoint | None:
        path = resumable_checkpoint(out, say)
        return None if path is None else load_checkpoint(path)

    def restore(self, ckpt: LoadedCheckpoint) -> None:
        single = CheckpointDir(ckpt.path).adapters  # absent from a pipeline's checkpoint: its stages' shards are merged
        load_trainable(self.model, single if single.exists() else ckpt.path, ckpt.trainable)
        self.optimizer.state = ckpt.optimizer_state
        self.optimizer.init(self.model.trainable_parameters())
