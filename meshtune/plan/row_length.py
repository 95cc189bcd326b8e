"""The row length of packed batches (data.pack) a run takes when it is given none: the cheapest per target token.

Packing removes padding, but attention over a packed row scores every query against all the row's
keys: the block-diagonal mask hides the other examples' keys, they are computed all the same. A token
in a row of w tokens costs the weights' multiply-adds C (weights_per_token) plus w scores in every block,
each heads x (2 head_dim + SCORE_COST) (score_cost): so a row costs w (C + A w), and rows much longer
than the break-even C / A cost more per token than the padding they save. A step costs STEP_OVERHEAD
besides its rows (its launch, the optimizer's update), which short rows in a batch of batch_size pay
over few tokens. Rows of one example waste the room the next does not fit in; longer rows fill better
and cost more per token. The candidates run from the longest example, rounded up to data.pad_to, in
steps of it up to LONG_ROW_FACTOR times the longest (never past data.max_seq_length); each packs the
split (a sample of it) as the run would, and the cheapest per token wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..data.batches import LONG_ROW_FACTOR, padded_width
from ..data.packing import pack_rows
from .model_facts import ModelFacts, read_model

SCORE_COST = 300
"""What one attention score costs in a training step besides its two dot products, in multiply-adds of
a matmul: the mask, the softmax and their backward, elementwise over heads x L x L. Fitted to the
packed step's time per token against the row length on the 2-core CPU, where the rows it picks are
the fastest of `meshtune bench packing --row-lengths` (docs/performance.md)."""
STEP_OVERHEAD = 5e7
"""What a step costs besides its tokens, in the same multiply-adds: about 7 ms on the 2-core CPU, where a token
of the embedded model (8e5 multiply-adds) takes 0.1 ms; a device whose launches cost more per multiply-add
gains more from longer rows than this gives them."""
SAMPLE = 4096
"""Examples packed per candidate length: the fill of rows depends on the lengths' spread, not their count."""
FALLBACK_BREAK_EVEN = 137
"""Tokens per row at which attention costs as much as the weights, for a model whose shapes the planner
cannot read: the embedded model's, so rows stay as short as a small model needs."""
FALLBACK_WEIGHTS = 8e5
"""Weights' multiply-adds per token of such a model: the embedded model's."""


@dataclass(frozen=True)
class RowLength:
    """The tokens a packed row holds and, in words, why that many."""

    tokens: int
    why: str
    picked: bool = False
    """Picked for the data and the model (pick_row_length), not given."""

    def line(self) -> str:
        """The run's one line about it."""
        return f"data.pack: rows of {self.tokens} tokens ({self.why})"


def weights_per_token(facts: ModelFacts) -> float:
    """Multiply-adds of the weights per token: every block's projections and MLP (a MoE block's routed
    experts a token takes and its shared one), and the head."""
    h, d = facts.hidden, facts.head_dim
    attention = 2 * h * facts.heads * d + 2 * h * facts.kv_heads * d
    if facts.experts:
        mlp = 3 * h * (facts.experts_per_token * facts.moe_intermediate + facts.shared_intermediate)
    else:
        mlp = 3 * h * facts.intermediate
    return float(facts.num_blocks * (attention + mlp) + facts.vocab * h)


def score_cost(facts: ModelFacts) -> float:
    """What one query-key pair costs over all blocks, in the same multiply-adds."""
    return float(facts.num_blocks * facts.heads * (2 * facts.head_dim + SCORE_COST))


def break_even(facts: ModelFacts | None) -> float:
    """The row length at which a token's attention costs as much as its weights (C / A)."""
    return FALLBACK_BREAK_EVEN if facts is None else weights_per_token(facts) / score_cost(facts)


def row_cost(lengths: np.ndarray, capacity: int, *, pad_to: int, batch_size: int, tokens_at_par: float,
             step_tokens: float) -> float:
    """The cost of `lengths` packed into rows of `capacity`, in tokens of weights' work: the sum over rows
    of w (1 + w / tokens_at_par), w a row's padded width, and `step_tokens` a step of `batch_size` rows."""
    fill = [int(lengths[r].sum()) for r in pack_rows(lengths, capacity)]
    width = np.array([padded_width(f, pad_to=pad_to, max_seq_length=capacity) for f in fill], dtype=np.float64)
    return float((width * (1 + width / tokens_at_par)).sum() + step_tokens * len(fill) / batch_size)


def pick_row_length(lengths: np.ndarray, *, max_seq_length: int, pad_to: int, batch_size: int,
                    facts: ModelFacts | None) -> RowLength:
    """The cheapest row length for a split of example `lengths` (in tokens, cut to `max_seq_length`) and this
    model: a multiple of `pad_to` that holds the longest example, at most LONG_ROW_FACTOR times it."""
    kept = np.minimum(np.asarray(lengths, dtype=np.int64), max_seq_length)
    longest = int(kept.max(initial=2))
    last = min(LONG_ROW_FACTOR * longest, max_seq_length)
    candidates = list(range(pad_to * -(-longest // pad_to), last + 1, pad_to)) or [max_seq_length]
    sample = kept[:: max(1, len(kept) // SAMPLE)]
    at_par = break_even(facts)
    step = STEP_OVERHEAD / (FALLBACK_WEIGHTS if facts is None else weights_per_token(facts))
    costs = [row_cost(sample, c, pad_to=pad_to, batch_size=batch_size, tokens_at_par=at_par, step_tokens=step)
             for c in candidates]
    best = candidates[int(np.argmin(costs))]  # the first of equal costs: the shortest
    model = ("" if facts is None else f", on a model whose attention costs as much as its weights at "
             f"{at_par:.0f}-token rows")
    return RowLength(best, f"the cheapest per target token for examples of up to {longest} tokens{model}; "
                           "--max-seq-length or --data.pack_length sets it", picked=True)


def packed_row_length(cfg: Any, lengths: np.ndarray) -> RowLength:
    """The packed row length of a run of `cfg` on a training split of example `lengths`: data.pack_length
    where set (a resumed run's records the length its start picked), data.max_seq_length where the user
    gave it, else pick_row_length's for the data and the model."""
    d = cfg.data
    if d.pack_length:
        longest = int(np.minimum(lengths, d.max_seq_length).max(initial=0))
        if d.pack_length < longest:  # rows hold examples whole: cutting them is max_seq_length's
            raise ValueError(f"data.pack_length {d.pack_length} is shorter than the longest training example "
                             f"({longest} tokens); give --data.pack_length {longest} or more, or 0 to pick it")
        return RowLength(d.pack_length, "data.pack_length")
    if "data.max_seq_length" in cfg.origins:
        return RowLength(d.max_seq_length, "data.max_seq_length")
    try:
        facts = read_model(cfg.resolved_model_path())
    except (ValueError, KeyError, OSError):  # the planner cannot read this model: rows a small model needs
        facts = None
    return pick_row_length(lengths, max_seq_length=d.max_seq_length, pad_to=d.pad_to,
                           batch_size=cfg.train.batch_size, facts=facts)
