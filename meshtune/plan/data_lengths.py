"""The row length `meshtune plan` plans for when it is given the data: the widest batch a run would build.

The train split is read and tokenized as `meshtune train` reads it (run_data.load_splits, the
token cache included), with the model's tokenizer; batches take examples sorted by length, so
the widest batch is the one that holds the longest example, padded as data/batches.py pads it.
Packed rows (data.pack) are as long as the run would make them (row_length.py).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any


def data_row_length(cfg: Any) -> tuple[int, str]:
    """(tokens per row of the widest batch, where that figure comes from in words) for cfg's data."""
    from mlx_lm.utils import load_tokenizer

    from ..data.batches import padded_width
    from ..runtime.mesh import Mesh
    from ..run_data import load_splits
    from .model_facts import resolve_model_folder
    from .row_length import packed_row_length

    tokenizer = load_tokenizer(resolve_model_folder(cfg.resolved_model_path()))
    with contextlib.redirect_stdout(sys.stderr):  # the data's warnings; stdout may be plan's JSON
        train = load_splits(cfg, tokenizer, Mesh.single(), need_valid=False, need_test=False, ways_out={}).train
    if cfg.data.pack:
        rows = packed_row_length(cfg, train.lengths)
        return rows.tokens, f"--data, packed rows: {rows.why}"
    longest = int(train.lengths.max(initial=0))
    width = padded_width(longest, pad_to=cfg.data.pad_to, max_seq_length=cfg.data.max_seq_length)
    cut = ", cut to data.max_seq_length" if longest > cfg.data.max_seq_length else ""
    return width, f"--data: the longest of {len(train)} examples, {longest} tokens, padded{cut}"
