"""data.pack (meshtune/data/packing.py): rows of several examples train exactly as the examples alone.

The packed loss and update equal the unpacked ones through the real compiled step on the embedded
tiny model; attention and targets never cross an example boundary; the packed batches shard,
shuffle and resume like unpacked ones.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

from meshtune.adapters import apply_adapters, trainable_parameters
from meshtune.data import BatchIterator, TokenizedDataset, check_packable
from meshtune.data.checks import trained_tokens
from meshtune.data.packing import pack_rows
from meshtune.parallel.data_parallel_step import build_step
from meshtune.runtime.mesh import Mesh
from meshtune.training.losses import target_mask
from support import TINY_MODEL


def _examples(n: int, seed: int = 0, vocab: int = 100) -> TokenizedDataset:
    rng = np.random.default_rng(seed)
    return TokenizedDataset.from_examples("train", [
        (rng.integers(3, vocab, size=int(rng.integers(3, 40))).tolist(), int(rng.integers(0, 4)))
        for _ in range(n)])


@pytest.fixture(scope="module")
def tiny():
    from mlx_lm.utils import load

    return load(str(TINY_MODEL))[0]


def test_rows_hold_every_example_once_within_capacity():
    ds = _examples(200)
    rows = pack_rows(ds.lengths, 64)
    assert sorted(np.concatenate(rows).tolist()) == list(range(200))
    assert max(int(ds.lengths[r].sum()) for r in rows) <= 64
    # Best-fit decreasing leaves little room: fewer than one row more than the tokens need.
    assert len(rows) <= -(-int(ds.lengths.sum()) // 64) + 1
    assert all(np.array_equal(a, b) for a, b in zip(rows, pack_rows(ds.lengths, 64)))
    long = pack_rows(np.array([100, 5], dtype=np.int32), 64)  # an example over capacity is cut, alone
    assert [r.tolist() for r in long] == [[0], [1]]


def test_targets_stay_inside_examples():
    ds = _examples(60, seed=1)
    it = BatchIterator(ds, batch_size=2, max_seq_length=128, loop=False, shuffle=False, pack=True)
    counted = 0
    for batch in it:
        tokens, slots = np.array(batch.tokens), np.array(batch.lengths)
        mask = np.array(target_mask(batch.lengths, tokens.shape[1] - 1))
        for b in range(tokens.shape[0]):
            for start, first, end in slots[b]:
                if end == 0:
                    continue
                # Target p predicts token p: the first token of an example (p == start) is never a target.
                assert not mask[b, start - 1] if start > 0 else True
                assert mask[b, first - 1:end - 1].all()
            counted += int(mask[b].sum())
    used = np.concatenate([it.rows[i] for i in it.batch_indices.reshape(-1)])
    assert counted == sum(trained_tokens(int(ds.lengths[i]), int(ds.offsets[i])) for i in used)


def _model(tiny_weights, seed=3):
    from mlx_lm.utils import load

    model = load(str(TINY_MODEL))[0]
    mx.random.seed(seed)
    apply_adapters(model, fine_tune_type="lora", num_layers=-1, keys=None, rank=4, scale=10.0, dropout=0.0)
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_b = mx.full(m.lora_b.shape, 0.01)
    return model


def _train_once(batch, tiny):
    """Loss sum, tokens and the updated adapter weights after one compiled step on `batch`."""
    model = _model(tiny)
    opt = optim.SGD(learning_rate=0.5)
    opt.init(model.trainable_parameters())
    step = build_step(model, opt, Mesh.single(), max_grad_norm=0.0, compile=True)
    ce, n, _ = step.finish(batch.tokens, batch.lengths, None, None)
    mx.eval(ce, n, model.parameters())
    return ce.item(), n.item(), trainable_parameters(model)


def test_packed_step_equals_unpacked(tiny):
    ds = _examples(16, seed=2, vocab=103)
    plain = next(iter(BatchIterator(ds, batch_size=16, max_seq_length=64, loop=False, shuffle=False)))
    rows = len(pack_rows(ds.lengths, 128))
    packed_it = BatchIterator(ds, batch_size=rows, max_seq_length=128, loop=False, shuffle=False, pack=True)
    assert rows > 1 and len(packed_it) == 1 and packed_it.batch_indices.size == rows  # every example, once
    packed = next(iter(packed_it))
    assert packed.lengths.ndim == 3 and packed.tokens.size < plain.tokens.size
    ce_a, n_a, w_a = _train_once(plain, tiny)
    ce_b, n_b, w_b = _train_once(packed, tiny)
    assert n_a == n_b
    np.testing.assert_allclose(ce_b, ce_a, rtol=1e-4)
    for k in w_a:
        np.testing.assert_allclose(np.array(w_b[k]), np.array(w_a[k]), rtol=1e-4, atol=1e-6)


def test_attention_stays_inside_each_example(tiny):
    ds = _examples(6, seed=4, vocab=103)
    it = BatchIterator(ds, batch_size=1, max_seq_length=256, loop=False, shuffle=False, pack=True)
    batch = next(iter(it))
    from meshtune.data.packing import packed_caches

    def logits(tokens):
        x = tokens[:, :-1]
        return np.array(tiny(x, cache=packed_caches(len(tiny.layers), batch.lengths, x.shape[1])))

    before = logits(batch.tokens)
    start, _, end = np.array(batch.lengths)[0, 1]  # change every token of the second example
    changed = np.array(batch.tokens)
    changed[0, start:end] = (changed[0, start:end] + 7) % 100 + 3
    after = logits(mx.array(changed))
    np.testing.assert_array_equal(after[0, :start], before[0, :start])  # the first example: untouched
    s2, _, e2 = np.array(batch.lengths)[0, 2]
    np.testing.assert_allclose(after[0, s2:e2 - 1], before[0, s2:e2 - 1], rtol=1e-5, atol=1e-5)  # the third too
    # And the first example's logits equal the example run alone.
    alone = np.array(tiny(mx.array(np.array(batch.tokens)[:, :start])))
    np.testing.assert_allclose(before[0, :start], alone[0], rtol=1e-4, atol=1e-4)


def test_packed_batches_shard_and_resume():
    ds = _examples(300, seed=5)
    kw = dict(batch_size=4, max_seq_length=96, seed=7, pack=True)
    whole = BatchIterator(ds, **kw)
    ranks = [BatchIterator(ds, rank=r, world_size=2, **kw) for r in range(2)]
    for _ in range(3):
        full = np.array(next(whole).tokens)
        parts = [np.array(next(r).tokens) for r in ranks]
        got = sorted(map(tuple, np.concatenate([p[:, :min(p.shape[1] for p in parts)] for p in parts])))
        assert got == sorted(map(tuple, full[:, :min(p.shape[1] for p in parts)]))
    state = whole.state()
    expect = [np.array(next(whole).tokens) for _ in range(len(whole) + 2)]  # across an epoch boundary
    resumed = BatchIterator(ds, **kw)
    resumed.load_state(state)
    for e in expect:
        np.testing.assert_array_equal(np.array(next(resumed).tokens), e)
    with pytest.raises(ValueError, match=r"pack into \d+ rows .* fewer than batch_size=64; .*--data.pack false"):
        BatchIterator(ds, batch_size=64, max_seq_length=2048, pack=True)


def test_models_without_rope_are_refused(tiny):
    check_packable(tiny)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    class NoRope(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Block(), Block()]

    with pytest.raises(ValueError, match=r"^data.pack: block 0 of .* no rotary position embedding .*"
                                         r"use --data.pack false$"):
        check_packable(NoRope())


def test_packed_rows_far_longer_than_the_examples_are_said_once_with_the_length_to_give():
    from meshtune.data import BatchIterator

    ds = _examples(400)  # at most 42 tokens
    longest = int(ds.lengths.max())
    said: list[str] = []
    BatchIterator(ds, batch_size=1, max_seq_length=2048, pad_to=32, pack=True, warn=said.append)
    assert len(said) == 1 and said[0].startswith(
        f"train: data.pack fills rows of 2048 tokens with examples of at most {longest}; ")
    assert said[0].endswith(f"give --data.pack_length {32 * -(-8 * longest // 32)} (8 of the longest example a "
                            "row), or leave out --max-seq-length and the run picks rows for the data")
    said.clear()
    BatchIterator(ds, batch_size=1, max_seq_length=16 * longest, pad_to=32, pack=True, warn=said.append)
    BatchIterator(ds, batch_size=1, max_seq_length=2048, pad_to=32, pack=False, warn=said.append)
    assert said == []
