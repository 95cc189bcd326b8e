"""Cut a lazily loaded model down to one pipeline stage's parts before any weight is read.

A pipeline rank computes only its stage: blocks [start, end), plus the embedding on the
first stage and the final norm and head on the last (a tied table also there, where the
head multiplies by it). `keep_stage` puts an `Elsewhere` stand-in, a module with no
parameters, in place of every other part. The block list keeps its length, so parameter
names stay the whole model's (model.layers.5...), as checkpoints and adapters files spell
them; and since mlx-lm's lazy load reads a weight only when it is first evaluated, the
dropped parts are never read from disk nor held in memory.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn


class Elsewhere(nn.Module):
    """Stand-in for a part of the model another pipeline stage holds: no parameters, not callable."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self._what = what

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._what} is held by another pipeline stage; this rank cannot compute it")


def keep_stage(model: nn.Module, inner: nn.Module, bounds: tuple[int, int], *, first: bool, last: bool,
               tied: bool) -> None:
    """Replace, in place, every part of `model` stage `bounds` does not compute with an `Elsewhere`.

    `inner` is the model's decoder (model.model); `tied`: the head multiplies by the embedding table.
    """
    start, end = bounds
    for i in range(len(inner.layers)):
        if not start <= i < end:
            inner.layers[i] = Elsewhere(f"block {i}")
    if not (first or (last and tied)):
        inner.embed_tokens = Elsewhere("the embedding")
    if not last:
        inner.norm = Elsewhere("the final norm")
        if "lm_head" in model:
            model.lm_head = Elsewhere("the head")
