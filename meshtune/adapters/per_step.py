"""The per-step hook: work an adapter does once per training step rather than once per layer call.

A training step (parallel/data_parallel_step.build_step, a pipeline stage's backward) runs
its forward and backward inside `step_context(modules, tokens)` and knows nothing
else of it. Each adapter that needs such work lists a `PerStepWork` in
`PER_STEP_WORK`: today DoRA's row norms, taken for every layer at once on CUDA
(step_norms.py); on other devices they enter and leave doing nothing.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Iterator, Protocol

import mlx.nn as nn

from .step_norms import step_row_norms


class PerStepWork(Protocol):
    """A context around one step's forward and backward of `modules` on batches of `tokens` rows."""

    def __call__(self, modules: nn.Module | list[nn.Module], tokens: int) -> AbstractContextManager[None]: ...


PER_STEP_WORK: tuple[PerStepWork, ...] = (step_row_norms,)


@contextmanager
def step_context(modules: nn.Module | list[nn.Module], tokens: int) -> Iterator[None]:
    """Every adapter's per-step work for a step of `modules` (a model, or a stage's blocks) on `tokens` rows."""
    with ExitStack() as stack:
        for work in PER_STEP_WORK:
            stack.enter_context(work(modules, tokens))
        yield
