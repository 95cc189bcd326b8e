"""A run's data as its config asks for it: the splits' source, the splits loaded, evaluation batches.

Shared by training (api.finetune) and by evaluating trained adapters (inference.evaluate_adapters),
so both read the same examples the same way.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .config import Config
from .data import BatchIterator, Features, load_datasets
from .runtime.mesh import Mesh


# How a training run does without each evaluation split, offered in the data's errors about it.
# Scoring one split (meshtune eval) has no such way out: it passes none.
TRAINING_WAYS_OUT = {"valid": "turn off validation with --val-batches 0", "test": "leave out --test"}


def split_names(cfg: Config) -> dict[str, str]:
    """Each split's name in the source (data.train_split, ...)."""
    return {"train": cfg.data.train_split, "valid": cfg.data.valid_split, "test": cfg.data.test_split}


def load_splits(cfg: Config, tokenizer: Any, mesh: Mesh, *, need_valid: bool, need_test: bool,
                ways_out: dict[str, str], need_train: bool = True) -> Any:
    """The splits of cfg's data, tokenized and checked (data.load_datasets); warnings said once;
    `ways_out` (e.g. TRAINING_WAYS_OUT) is offered in the errors about a split."""
    d = cfg.data
    return load_datasets(str(cfg.resolved_data_path()), tokenizer, mask_prompt=d.mask_prompt,
                         features=Features(prompt_feature=d.prompt_feature, completion_feature=d.completion_feature,
                                           text_feature=d.text_feature, chat_feature=d.chat_feature),
                         need_train=need_train, need_valid=need_valid, need_test=need_test,
                         max_length=None if d.truncate else d.max_seq_length, max_seq_length=d.max_seq_length,
                         skip_empty=d.skip_empty, warn=warner(mesh), splits=split_names(cfg), ways_out=ways_out)


def eval_batches(dataset: Any, cfg: Config, mesh: Mesh, limit: int, ways_out: dict[str, str]) -> list[Any]:
    """`limit` (-1: all) complete batches of a split for this rank, the same ones every eval.

    Shuffled by the seed, so a capped eval sees short and long examples alike. `ways_out`: as load_splits'.
    """
    it = BatchIterator(dataset, batch_size=cfg.train.batch_size, max_seq_length=cfg.data.max_seq_length,
                       pad_to=cfg.data.pad_to, seed=cfg.train.seed, rank=mesh.dp_rank,
                       world_size=mesh.dp, loop=False, shuffle=True, warn=warner(mesh),
                       way_out=ways_out.get(dataset.name, ""))
    batches = list(it)
    return batches if limit < 0 else batches[:limit]


def tail_batch(dataset: Any, cfg: Config, full: int) -> list[Any]:
    """The batch of the examples `full` complete batches leave out (the longest: batches take the shortest
    first), as one smaller batch; empty when none are left. Scoring a whole split needs them (meshtune eval)."""
    from .data import TokenizedDataset

    per_batch = cfg.train.batch_size
    order = np.argsort(dataset.lengths, kind="stable")  # as BatchIterator sorts, so the same ones are left
    rest = order[full * per_batch:]
    if len(rest) == 0:
        return []
    left = TokenizedDataset.from_examples(dataset.name, (dataset[int(i)] for i in rest), path=dataset.path,
                                          format=dataset.format)
    return list(BatchIterator(left, batch_size=len(rest), max_seq_length=cfg.data.max_seq_length,
                              pad_to=cfg.data.pad_to, seed=cfg.train.seed, loop=False, shuffle=False,
                              warn=lambda m: None))  # the full batches warned about truncation already


def warner(mesh: Mesh) -> Callable[[str], None]:
    """Data warnings are printed once, by the writer rank."""
    return (lambda m: print(f"warning: {m}")) if mesh.is_writer else (lambda m: None)
