"""Data for fine-tuning: jsonl splits tokenized once, then length-sorted padded batches.

``load_datasets``/``load_split`` read mlx-lm's text, completions and chat jsonl
formats into compact ``TokenizedDataset``s; ``BatchIterator`` turns one into
mlx-lm-compatible ``Batch(tokens, lengths)`` batches for one rank, with a
cursor that resumes exactly.  Every example must leave a token in the loss (checks.py).
"""

from .batches import Batch, BatchIterator, TruncationWarning, padded_width
from .checks import EmptyExample, SkippedExamplesWarning
from .dataset import Datasets, TokenizedDataset
from .formats import Features, detect_format, load_datasets, load_split, tokenize_row

__all__ = [
    "Batch",
    "BatchIterator",
    "Datasets",
    "EmptyExample",
    "Features",
    "SkippedExamplesWarning",
    "TokenizedDataset",
    "TruncationWarning",
    "detect_format",
    "load_datasets",
    "load_split",
    "padded_width",
    "tokenize_row",
]
