"""The interface the training loop and `finetune` call on a parallel strategy.

One strategy per parallel layout, built once at the entry point from the Mesh
(api.finetune): `parallel/data_parallel.DataParallel` (one process is its world of
one) and `parallel/pipeline.Pipeline` (stages, with data-parallel replicas of the
pipeline). The loop and `finetune` call only these methods, so neither knows which
layout runs, how gradients travel or where the weights live. Each class also has
`check(cfg, mesh, model_path)`, what the layout refuses before the model loads, and
`from_config(cfg, mesh, model, optimizer, overlap=, say=, step_context=)`, which `finetune`
calls on the class it picks (step_context: the adapters' per-step work, adapters.StepContext).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from .checkpoint import LoadedCheckpoint, TrainingState
from .update import StepVerdict


class WaitClock:
    """Seconds a strategy's steps spent waiting, added up until `take` (Strategy.take_waits)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        self.seconds += max(seconds, 0.0)

    def take(self) -> float:
        """The seconds since the last take, and start again from zero."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class Strategy(Protocol):
    model: nn.Module
    optimizer: optim.Optimizer

    def step(self, batches: Iterator[Any]) -> tuple[list[tuple[mx.array, mx.array]], StepVerdict]:
        """One optimizer step over the next `grad_accumulation_steps` batches: this rank's
        (loss sum, target tokens) of each, in order, and the step's verdict.

        Reports add them over every rank, so a rank whose batches another rank
        already counts (a pipeline's earlier stages) returns zeros. The verdict
        (training/update.py) says whether the update was applied; it is the same on
        every rank, and a step that was not applied changed no weight and no optimizer
        state. Its arrays may still be in flight: reading them waits for the step.
        """

    def take_waits(self) -> dict[str, float]:
        """Seconds this rank's steps waited since the last call, by kind, then reset: "comm" (blocked
        on the data-parallel gradient sums after its own backward was done), "bubble" (a pipeline
        stage in its schedule's sends and receives); {} where nothing is measured. Reports turn
        them into comm_share / bubble_share of the step time (training/metrics.wait_shares)."""

    def evaluate(self, batches: Iterable[Any], beat: Callable[[], None] = lambda: None) -> tuple[float, int]:
        """Token-weighted loss of the current weights over `batches`: (loss, global tokens), on every rank."""

    def write_weights(self, path: Path) -> None:
        """Write every trained weight, by name, into the one safetensors file `path` in one process's
        layout (a collective where they are spread over ranks; the writer writes)."""

    def save(self, out: Path, state: TrainingState, *, config: dict[str, Any], keep: int) -> None:
        """Write this step's checkpoint under `out` (a collective), keeping the newest `keep` (0: all)."""

    def latest_checkpoint(self, out: Path, say: Callable[[str], None]) -> LoadedCheckpoint | None:
        """The newest intact checkpoint under `out`, as this rank resumes it (each one skipped said)."""

    def restore(self, ckpt: LoadedCheckpoint) -> None:
        """Load `ckpt`'s trained weights and optimizer state into the model and optimizer."""
