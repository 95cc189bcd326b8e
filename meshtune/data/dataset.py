"""Compact in-memory container for a tokenized data split.

A split is tokenized once, up front, and kept as a single flat ``int32`` token
array plus per-example ``starts``, ``lengths`` and prompt-mask ``offsets``.
That is a few bytes per token instead of a Python list of Python ints per
example, and lets the batcher sort and pad with vectorised numpy.  Indexing an
example gives ``(tokens, offset)`` exactly like mlx-lm's processed datasets, so
a ``TokenizedDataset`` can also be handed to ``mlx_lm.tuner.trainer.iterate_batches``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, NamedTuple, Optional, Sequence, Tuple

import numpy as np


@dataclass(frozen=True, eq=False)
class TokenizedDataset:
    """One tokenized split: example ``i`` is ``tokens[starts[i] : starts[i] + lengths[i]]``.

    ``offsets[i]`` is the number of leading prompt tokens excluded from the loss
    (0 when the prompt is not masked).  ``format`` is "text", "completions",
    "chat" or "tokens" (built directly from token lists).  ``skipped`` lists the
    ``(line, why)`` of rows left out because they had nothing to learn (``data.skip_empty``).
    ``system_prompt`` is the system message every chat row opens with, when they share one
    (generate and serve put it before a user's message, as the model was trained). ``no_reply`` lists
    the lines of chat rows kept with no assistant message (unmasked, they train on the other messages).
    """

    name: str
    path: Optional[Path]
    format: str
    tokens: np.ndarray  # int32, all examples concatenated
    starts: np.ndarray  # int64, start of each example in `tokens`
    lengths: np.ndarray  # int32, token count of each example
    offsets: np.ndarray  # int32, prompt-mask offset of each example
    skipped: Tuple[Tuple[int, str], ...] = ()
    system_prompt: Optional[str] = None
    no_reply: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = self.lengths.shape[0]
        if not (self.starts.shape == self.offsets.shape == (n,)):
            raise ValueError(
                f"{self.name}: starts, lengths and offsets must all have shape ({n},)"
            )
        if self.tokens.dtype != np.int32 or self.lengths.dtype != np.int32:
            raise ValueError(f"{self.name}: tokens and lengths must be int32 arrays")

    @classmethod
    def from_examples(
        cls,
        name: str,
        examples: Iterable[Tuple[Sequence[int], int]],
        *,
        path: Optional[Path] = None,
        format: str = "tokens",
        skipped: Iterable[Tuple[int, str]] = (),
        system_prompt: Optional[str] = None,
        no_reply: Iterable[int] = (),
    ) -> "TokenizedDataset":
        """Pack ``(tokens, offset)`` pairs into one compact dataset."""
        arrays = []
        offsets = []
        for toks, offset in examples:
            arrays.append(np.asarray(toks, dtype=np.int32).reshape(-1))
            offsets.append(int(offset))
        lengths = np.fromiter((a.shape[0] for a in arrays), np.int32, len(arrays))
        starts = np.zeros(len(arrays), dtype=np.int64)
        if len(arrays) > 1:
            starts[1:] = np.cumsum(lengths[:-1], dtype=np.int64)
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
        return cls(
            name=name,
            path=path,
            format=format,
            tokens=tokens,
            starts=starts,
            lengths=lengths,
            offsets=np.asarray(offsets, dtype=np.int32).reshape(-1),
            skipped=tuple((int(line), str(why)) for line, why in skipped),
            system_prompt=system_prompt,
            no_reply=tuple(int(line) for line in no_reply),
        )

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, idx: int) -> Tuple[np.ndarray, int]:
        """``(tokens, offset)`` of one example; the tokens are a read-only view."""
        n = len(self)
        i = int(idx)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"{self.name}: index {idx} out of range for {n} examples")
        start = int(self.starts[i])
        view = self.tokens[start : start + int(self.lengths[i])]
        view.flags.writeable = False
        return view, int(self.offsets[i])

    @property
    def num_tokens(self) -> int:
        """Total tokens over all examples."""
        return int(self.lengths.sum(dtype=np.int64))


class Datasets(NamedTuple):
    """The train/valid/test splits of a data folder; a split not asked for is None."""

    train: Optional[TokenizedDataset]
    valid: Optional[TokenizedDataset]
    test: Optional[TokenizedDataset]
