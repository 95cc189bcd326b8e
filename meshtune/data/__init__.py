"""Data for fine-tuning: splits tokenized once, then length-sorted padded (or packed) batches.

``load_datasets`` reads mlx-lm's text, completions and chat formats from a jsonl folder, a
saved Hugging Face dataset, parquet files or a hub id (sources.py) into compact
``TokenizedDataset``s (``load_split``: one jsonl file); ``BatchIterator`` turns one into
mlx-lm-compatible ``Batch(tokens, lengths)`` batches for one rank, packed with ``pack``
(packing.py), with a cursor that resumes exactly.  Every example must leave a token in the
loss (checks.py).
"""

from .batches import Batch, BatchIterator, TruncationWarning, padded_width
from .checks import EmptyExample, SkippedExamplesWarning
from .dataset import Datasets, TokenizedDataset
from .formats import Features, detect_format, load_split, tokenize_row
from .packing import check_packable
from .sources import check_source, load_datasets

__all__ = [
    "Batch",
    "BatchIterator",
    "Datasets",
    "EmptyExample",
    "Features",
    "SkippedExamplesWarning",
    "TokenizedDataset",
    "TruncationWarning",
    "check_packable",
    "check_source",
    "detect_format",
    "load_datasets",
    "load_split",
    "padded_width",
    "tokenize_row",
]
