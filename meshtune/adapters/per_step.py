"""The per-step hook: work an adapter does once per training step rather than once per layer call.

A run builds one `StepContext` (api.finetune, from the config and the blocks gradient checkpointing
recomputes) and hands it to its training step (parallel/data_parallel_step.build_step, a pipeline
stage), which runs each forward and backward inside `step_context(modules, tokens)` and knows nothing
else of it. It holds a `PerStepWork` for each adapter that needs one: today DoRA's row norms, taken for
every layer at once on CUDA (step_norms.py); on other devices they enter and leave doing nothing.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Iterator, Protocol

import mlx.nn as nn

from .step_norms import StepRowNorms


class PerStepWork(Protocol):
    """A context around one step's forward and backward of `modules` on batches of `tokens` rows."""

    def __call__(self, modules: nn.Module | list[nn.Module], tokens: int) -> AbstractContextManager[None]: ...


class StepContext:
    """Every adapter's per-step work for one run's training step: `work`, or without it each adapter's
    default (for_run builds a run's)."""

    def __init__(self, *work: PerStepWork) -> None:
        self.work: tuple[PerStepWork, ...] = work or (StepRowNorms(),)

    @classmethod
    def for_run(cls, *, dora_fold: bool | str = "auto", recomputed: tuple[type, ...] = ()) -> "StepContext":
        """A run's: `dora_fold` (adapter.dora_fold), whether DoRA's step folds the row scale into the weights
        (True, False or "auto": StepRowNorms.fold); `recomputed`, the block classes recomputed in the
        backward (training/grad_checkpoint.enable_grad_checkpoint returns each)."""
        return cls(StepRowNorms(fold=dora_fold, recomputed=recomputed))

    @contextmanager
    def __call__(self, modules: nn.Module | list[nn.Module], tokens: int) -> Iterator[None]:
        """Every adapter's per-step work for a step of `modules` (a model, or a stage's blocks) on `tokens` rows."""
        with ExitStack() as stack:
            for work in self.work:
                stack.enter_context(work(modules, tokens))
            yield
