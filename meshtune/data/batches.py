"""Length-sorted, padded, rank-sharded batches with a resumable cursor.

As ``mlx_lm.tuner.trainer.iterate_batches``: examples sorted by length (stable), cut into global batches,
rank ``r`` of ``W`` taking every ``W``-th example from ``r``, each batch right-padded to ``1 + pad_to *
ceil(max_len / pad_to)`` columns (at most ``max_seq_length``); ``Batch(tokens, lengths)`` suits mlx-lm's
``default_loss``. Unlike it, on purpose: training completes the last batch with the shortest examples
(``fill_last``, as torch's DistributedSampler repeats examples) where mlx-lm drops the longest, so every
epoch trains every example; batches are padded once and cached; epoch ``e``'s order is drawn from
``(seed, e)`` alone, so the cursor ``(epoch, position)`` resumes exactly on every rank.
``inputs_multiple_of`` (128 on an NVIDIA GPU, runtime/cuda.py) widens a batch with masked columns
(padded_width); with ``pack`` the unit is a packed row (packing.py). docs/datasets.md has the rest.
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import mlx.core as mx
import numpy as np

from .dataset import TokenizedDataset
from .packing import pack_rows, packed_lengths


class Batch(NamedTuple):
    """One local batch: ``tokens`` int32 [B, width], ``lengths`` int32 [B, 2] = (offset, length),
    or for packed rows [B, K, 3] = (start, first target, end) per example (packing.py).

    A tuple, so ``tokens, lengths = batch`` and ``loss(model, *batch)`` work like
    mlx-lm's ``(batch, lengths)`` pair.
    """

    tokens: mx.array
    lengths: mx.array


class TruncationWarning(UserWarning):
    """Some examples of a split are longer than ``max_seq_length``."""


class LongRowsWarning(UserWarning):
    """data.pack's rows are far longer than the examples (LONG_ROW_FACTOR): they train slower than short rows."""


def content_digest(dataset: TokenizedDataset) -> str:
    """A digest of what a split trains on (its tokens, lengths and prompt offsets): a checkpoint's cursor keeps
    it, so a resume on data that changed (the same row count included) is seen."""
    h = hashlib.blake2b(digest_size=16)
    for part in (dataset.tokens, dataset.lengths, dataset.offsets):
        h.update(np.ascontiguousarray(part))
    return h.hexdigest()


# Widening a batch for inputs_multiple_of costs its padding columns in every layer, so it is done
# only where they are at most this fraction of the inputs: 1023 -> 1024 or 992 -> 1024, not 96 -> 128.
MAX_WIDENING = 1 / 16


def padded_width(max_len: int, *, pad_to: int, max_seq_length: int,
                 inputs_multiple_of: Optional[int] = None) -> int:
    """Columns of a batch whose longest example has ``max_len`` tokens.

    mlx-lm's rule: one more than a multiple of ``pad_to``, so the model inputs (all but the
    last column) are a multiple of ``pad_to``, capped at ``max_seq_length``. With
    ``inputs_multiple_of``, then widened until the inputs are a multiple of that (a 1024-column
    batch, 1023 inputs, becomes 1025 columns for 128), where that adds at most MAX_WIDENING of
    the inputs and leaves them no more than ``max_seq_length``: a model's position table holds
    that many, and positions past it would be out of its range.
    """
    width = min(1 + pad_to * -(-max_len // pad_to), max_seq_length)
    if inputs_multiple_of:
        wider = 1 + inputs_multiple_of * -(-(width - 1) // inputs_multiple_of)
        if wider - width <= MAX_WIDENING * (width - 1) and wider - 1 <= max_seq_length:
            width = wider
    return width


# A packed row this many times longer than the longest example is said to cost speed: on the embedded
# model `bench packing` gains 1.62x per target token with rows of 4x the longest arithmetic example and
# 1.01x with rows of 11x (docs/performance.md), while 2,048-token rows of ~70-token chats (29x) ran 250x
# slower than unpacked batches. A length the run picks (plan/row_length.py) stays within it.
LONG_ROW_FACTOR = 16
SUGGESTED_ROW_FACTOR = 8


def _warn_long_rows(dataset: TokenizedDataset, max_seq_length: int, pad_to: int,
                    warn: Optional[Callable[[str], None]]) -> None:
    """One warning when data.pack's rows are far longer than the examples, with the length to give."""
    longest = int(dataset.lengths.max(initial=0))
    if longest == 0 or max_seq_length <= LONG_ROW_FACTOR * longest:
        return
    suggest = pad_to * -(-SUGGESTED_ROW_FACTOR * longest // pad_to)
    message = (f"{dataset.name}: data.pack fills rows of {max_seq_length} tokens with examples of at most "
               f"{longest}; attention over a packed row costs more per token the longer the row, so these rows "
               f"train slower than short ones: give --data.pack_length {suggest} ({SUGGESTED_ROW_FACTOR} of the "
               "longest example a row), or leave out --max-seq-length and the run picks rows for the data")
    if warn is None:
        warnings.warn(message, LongRowsWarning, stacklevel=4)
    else:
        warn(message)


class BatchIterator:
    """Iterate a split's batches for one rank, forever (``loop=True``) or once.

    ``len(it)`` and ``it.batches_per_epoch`` count batches per epoch (global
    batches, of which this rank yields its share).  With ``loop=False`` one pass
    is made in sorted order (unless ``shuffle=True``); iterating again after the
    pass has finished starts a new pass.  ``fill_last`` (default: ``loop``) completes
    the last batch (``global_batches``), so an epoch trains every example.
    ``state()``/``load_state()`` save and restore the cursor.  ``warn`` receives the
    one truncation message of the split (default: ``warnings.warn`` with
    ``TruncationWarning``).  ``way_out``: how the caller does without this split
    ("leave out --test"), offered when it has too few examples.
    """

    def __init__(
        self,
        dataset: TokenizedDataset,
        *,
        batch_size: int,
        max_seq_length: int,
        pad_to: int = 32,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        loop: bool = True,
        shuffle: Optional[bool] = None,
        fill_last: Optional[bool] = None,
        warn: Optional[Callable[[str], None]] = None,
        pack: bool = False,
        inputs_multiple_of: Optional[int] = None,
        way_out: str = "",
    ) -> None:
        _check_options(dataset.name, batch_size, max_seq_length, pad_to, seed, rank, world_size)
        # The unit a batch is made of: an example, or a packed row of examples (data.pack).
        self.rows = pack_rows(dataset.lengths, max_seq_length) if pack else None
        unit_lengths, unit_tokens = self._units(dataset, batch_size, max_seq_length, pad_to, warn, way_out)
        self.dataset = dataset
        self.batch_size = batch_size
        self.max_seq_length = max_seq_length
        self.pad_to = pad_to
        self.inputs_multiple_of = inputs_multiple_of
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.loop = loop
        self.shuffle = loop if shuffle is None else bool(shuffle)
        self.fill_last = loop if fill_last is None else bool(fill_last)

        # A stable sort keeps equal-length examples in file order, as Python's
        # sorted() does in mlx-lm, so both libraries form the same batches.
        order = np.argsort(unit_lengths, kind="stable")
        global_idx = global_batches(order, unit_tokens, batch_size, fill_last=self.fill_last)
        n_batches = global_idx.shape[0]
        # idx[i + r : i + batch_size : W] of mlx-lm is column r, r+W, ... of the row.
        self._batch_indices = np.ascontiguousarray(global_idx[:, rank::world_size])
        self._batch_indices.flags.writeable = False
        self._warn_truncated(global_idx, warn)

        # Padded once here: every later step only wraps cached arrays.
        self._cache: List[Tuple[np.ndarray, np.ndarray]] = [
            self._pad(row) for row in self._batch_indices
        ]
        self._epoch = 0
        self._position = 0
        self._order_epoch = -1
        self._order = np.arange(n_batches)

    def _units(self, dataset: TokenizedDataset, batch_size: int, max_seq_length: int, pad_to: int,
               warn: Optional[Callable[[str], None]], way_out: str) -> Tuple[np.ndarray, np.ndarray]:
        """(what the batches sort by, the tokens each holds) per unit (example, or packed row: fullest
        first, so the last batch holds the least filled); a split too small for one batch is a ValueError
        naming the fix."""
        name = dataset.name
        if self.rows is not None:
            _warn_long_rows(dataset, max_seq_length, pad_to, warn)
            unit_tokens = np.array([np.minimum(dataset.lengths[r], max_seq_length).sum() for r in self.rows])
            self._slots = max(len(r) for r in self.rows)
            if len(self.rows) < batch_size:
                raise ValueError(
                    f"{name}: its {len(dataset)} examples pack into {len(self.rows)} rows of "
                    f"max_seq_length={max_seq_length} tokens, fewer than batch_size={batch_size}; lower "
                    f"--batch-size to at most {len(self.rows)}, lower --max-seq-length, or use --data.pack false"
                )
            return -unit_tokens, unit_tokens
        if len(dataset) < batch_size:
            where = f"{name} ({dataset.path})" if dataset.path is not None else name
            raise ValueError(
                f"{where}: has {len(dataset)} examples, fewer than batch_size={batch_size};"
                f" add examples, give --batch-size {len(dataset)} (or less){f', or {way_out}' if way_out else ''}"
            )
        return dataset.lengths, np.minimum(dataset.lengths, max_seq_length)

    def _warn_truncated(self, global_idx: np.ndarray, warn: Optional[Callable[[str], None]]) -> None:
        """Say once what the batches cut: tokens past max_seq_length (a unit the last batch repeats counted
        once)."""
        used = np.unique(global_idx)
        if self.rows is not None:
            used = np.concatenate([self.rows[i] for i in used])
        message = _truncation_message(self.dataset.name, used, self.dataset, self.max_seq_length)
        if message is not None:
            if warn is None:
                warnings.warn(message, TruncationWarning, stacklevel=3)  # the caller of __init__
            else:
                warn(message)

    @functools.cached_property
    def digest(self) -> str:
        """The split's content digest, which a saved cursor carries: hashed when a cursor is first saved or
        checked, not for iterators that never are (evaluation)."""
        return content_digest(self.dataset)

    # ------------------------------------------------------------------ sizes
    @property
    def batches_per_epoch(self) -> int:
        """Global batches per epoch (= batches this rank yields per epoch)."""
        return int(self._batch_indices.shape[0])

    def __len__(self) -> int:
        return self.batches_per_epoch

    @property
    def local_batch_size(self) -> int:
        """Examples per batch on this rank: ``batch_size // world_size``."""
        return self.batch_size // self.world_size

    @property
    def batch_indices(self) -> np.ndarray:
        """Dataset indices (packed: row indices into ``rows``) of this rank's batches in sorted order,
        [batches, local]; with ``fill_last`` the last batch repeats some of the first (global_batches)."""
        return self._batch_indices

    # -------------------------------------------------------------- iteration
    def epoch_order(self, epoch: int) -> np.ndarray:
        """Order in which epoch ``epoch`` visits the sorted batches."""
        if not self.shuffle:
            return np.arange(self.batches_per_epoch)
        # Seeding with (seed, epoch) alone makes any epoch reproducible in
        # isolation, which is what lets a cursor resume mid-run.
        rng = np.random.default_rng([self.seed, epoch])
        return rng.permutation(self.batches_per_epoch)

    def __iter__(self) -> "BatchIterator":
        if not self.loop and self._epoch >= 1:
            self._epoch, self._position = 0, 0  # a finished pass restarts
        return self

    def __next__(self) -> Batch:
        if not self.loop and self._epoch >= 1:
            raise StopIteration
        if self._order_epoch != self._epoch:
            self._order = self.epoch_order(self._epoch)
            self._order_epoch = self._epoch
        tokens, lengths = self._cache[int(self._order[self._position])]
        self._position += 1
        if self._position == self.batches_per_epoch:
            self._epoch, self._position = self._epoch + 1, 0
        return Batch(mx.array(tokens), mx.array(lengths))

    # ----------------------------------------------------------------- cursor
    def state(self) -> Dict[str, Any]:
        """JSON-serialisable cursor: the next batch is ``position`` of ``epoch`` of the data ``digest`` names."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "batches_per_epoch": self.batches_per_epoch,
            "digest": self.digest,
        }

    def load_state(self, state: Dict[str, Any], *, changed_ok: bool = False) -> None:
        """Restore a cursor from ``state()``; the next batch is the one that was due. A cursor of other
        data (its digest) is refused unless ``changed_ok`` (data.changed_ok)."""
        name = self.dataset.name
        saved = state.get("digest") if isinstance(state, dict) else None
        if saved is not None and saved != self.digest and not changed_ok:
            where = f" ({self.dataset.path})" if self.dataset.path else ""
            raise ValueError(
                f"--resume: the {name} data{where} is not the data the checkpoint was trained on (its "
                "content changed since: the digest in the checkpoint's cursor differs); restore it, or "
                "give --data.changed_ok true to go on with the new data from the saved position"
            )
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"{name}: batch cursor {state!r} lacks integer 'epoch' and 'position';"
                " pass the dict returned by BatchIterator.state()"
            ) from None
        saved_n = state.get("batches_per_epoch", self.batches_per_epoch)
        if int(saved_n) != self.batches_per_epoch:
            raise ValueError(
                f"{name}: batch cursor was saved with {saved_n} batches per epoch but "
                f"this data and batch_size give {self.batches_per_epoch}; resume with "
                "the same data and batch_size or start without the cursor"
            )
        saved_seed = state.get("seed", self.seed)
        if int(saved_seed) != self.seed:
            raise ValueError(
                f"{name}: batch cursor was saved with seed={saved_seed} but this run "
                f"has seed={self.seed}; resume with seed={saved_seed}"
            )
        if epoch < 0 or not 0 <= position < self.batches_per_epoch:
            raise ValueError(
                f"{name}: batch cursor epoch={epoch} position={position} is out of "
                f"range (position must be below {self.batches_per_epoch}); pass the "
                "dict returned by BatchIterator.state()"
            )
        self._epoch, self._position = epoch, position

    # ---------------------------------------------------------------- helpers
    def _pad(self, rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        if self.rows is not None:
            return self._pack(rows)
        ds, msl = self.dataset, self.max_seq_length
        lengths = ds.lengths[rows]
        width = padded_width(int(lengths.max()), pad_to=self.pad_to, max_seq_length=msl,
                             inputs_multiple_of=self.inputs_multiple_of)
        kept = np.minimum(lengths, msl)
        tokens = np.zeros((rows.shape[0], width), dtype=np.int32)
        for j, i in enumerate(rows):
            start = int(ds.starts[i])
            tokens[j, : kept[j]] = ds.tokens[start : start + int(kept[j])]
        pairs = np.stack([ds.offsets[rows], kept], axis=1).astype(np.int32)
        return tokens, pairs

    def _pack(self, units: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """One batch of packed rows: tokens [B, width] and slots [B, K, 3]."""
        ds, msl = self.dataset, self.max_seq_length
        members = [self.rows[int(u)] for u in units]
        kept = [np.minimum(ds.lengths[m], msl) for m in members]
        width = padded_width(max(int(k.sum()) for k in kept), pad_to=self.pad_to, max_seq_length=msl,
                             inputs_multiple_of=self.inputs_multiple_of)
        tokens = np.zeros((len(members), width), dtype=np.int32)
        slots = np.zeros((len(members), self._slots, 3), dtype=np.int32)
        for j, (m, k) in enumerate(zip(members, kept)):
            at = 0
            for i, n in zip(m.tolist(), k.tolist()):
                start = int(ds.starts[i])
                tokens[j, at : at + n] = ds.tokens[start : start + n]
                at += n
            slots[j] = packed_lengths(ds.offsets[m], k, self._slots)
        return tokens, slots


def global_batches(order: np.ndarray, unit_tokens: np.ndarray, batch_size: int, *,
                   fill_last: bool) -> np.ndarray:
    """One epoch's global batches, [batches, batch_size] unit indices: ``order`` (the units sorted) cut into
    runs of ``batch_size``.

    The units an incomplete last run holds are the longest examples (packed: the least filled rows). Without
    ``fill_last`` they are left out, as mlx-lm does. With it they are completed to a batch with the
    ``batch_size - left`` other units of the fewest tokens (``unit_tokens``: the shortest examples, the least
    filled rows), the units kept in sorted order; the split has at least one full batch, so there are enough.
    """
    n_full = len(order) // batch_size
    placed = order[: n_full * batch_size]
    left = order[n_full * batch_size:]
    batches = placed.reshape(n_full, batch_size)
    if not fill_last or len(left) == 0:
        return batches
    # The stable sort takes the earlier of equal units; sorting the picks keeps the batch in the split's order.
    picks = np.sort(np.argsort(unit_tokens[placed], kind="stable")[: batch_size - len(left)])
    return np.concatenate([batches, np.concatenate([placed[picks], left])[None]])


def _check_options(
    name: str,
    batch_size: int,
    max_seq_length: int,
    pad_to: int,
    seed: int,
    rank: int,
    world_size: int,
) -> None:
    if batch_size < 1:
        raise ValueError(f"{name}: batch_size={batch_size} must be at least 1")
    if max_seq_length < 2:
        raise ValueError(
            f"{name}: max_seq_length={max_seq_length} must be at least 2 (one input "
            "and one target token)"
        )
    if pad_to < 1:
        raise ValueError(f"{name}: pad_to={pad_to} must be at least 1")
    if seed < 0:
        raise ValueError(f"{name}: seed={seed} must be a non-negative integer")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"{name}: rank={rank} must be in 0..world_size-1 with world_size="
            f"{world_size} >= 1"
        )
    if batch_size % world_size:
        raise ValueError(
            f"{name}: batch_size={batch_size} is not divisible by world_size="
            f"{world_size}; use a batch_size that is a multiple of {world_size}"
        )


def _truncation_message(
    name: str, used: np.ndarray, ds: TokenizedDataset, max_seq_length: int
) -> Optional[str]:
    """One message for the whole split, counting examples that are actually batched (``used``, each once)."""
    long = ds.lengths[used] > max_seq_length
    n_long = int(long.sum())
    if n_long == 0:
        return None
    message = (
        f"{name}: {n_long} of {used.shape[0]} examples exceed "
        f"max_seq_length={max_seq_length} and will be truncated"
    )
    # A truncated example trains on target positions offset..max_seq_length-1;
    # a prompt that long leaves it nothing.
    n_empty = int((ds.offsets[used][long] >= max_seq_length).sum())
    if n_empty:
        message += f" ({n_empty} of them lose every trained token to the cut)"
    return message + "; raise max_seq_length or split the long examples"
