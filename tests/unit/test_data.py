"""Tests for meshtune.data: jsonl formats, tokenization and batching vs mlx-lm.

A character-level tokenizer is built in memory (no downloads) and wrapped in
transformers' PreTrainedTokenizerFast with a small Jinja chat template, so the
same tokenizer can be fed to mlx-lm's own dataset classes and batcher and the
results compared token for token.
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from meshtune.data import (
    Batch,
    BatchIterator,
    Features,
    TokenizedDataset,
    TruncationWarning,
    load_datasets,
    load_split,
)
from meshtune.data.batches import padded_width

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
mlx_datasets = pytest.importorskip("mlx_lm.tuner.datasets")
mlx_trainer = pytest.importorskip("mlx_lm.tuner.trainer")

TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>{{ tools | tojson }}</s>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Renders the message count first, so a prompt is never a prefix of the whole.
BAD_TEMPLATE = "{{ messages | length }}" + TEMPLATE
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
TINY_LLAMA = Path(__file__).resolve().parents[2] / "meshtune" / "assets" / "tiny-llama"


def make_tokenizer(template: str = TEMPLATE):
    from tokenizers import Tokenizer, models, processors

    special = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(special + chars)}
    # BPE without merges splits text into single characters.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(special)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    hf.chat_template = template
    return hf


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def write_jsonl(folder: Path, name: str, rows) -> Path:
    path = folder / f"{name}.jsonl"
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + ("\n" if lines else ""), encoding="utf-8")
    return path


def rand_text(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice("abcdefgh ijk.") for _ in range(rng.randint(lo, hi)))


def completion_rows(n: int, seed: int = 0, hi: int = 60):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        row = {"prompt": rand_text(rng, 1, hi), "completion": rand_text(rng, 1, hi)}
        if i % 3 == 0:
            row["tools"] = TOOLS
        rows.append(row)
    return rows


def as_lists(ds: TokenizedDataset):
    return [(ds[i][0].tolist(), ds[i][1]) for i in range(len(ds))]


# --------------------------------------------------------------- formats


def test_text_matches_mlx_lm(tmp_path, tok):
    rows = [{"text": "hello world"}, {"text": "a</s>"}, {"text": ""}, {"text": "x" * 50}]
    path = write_jsonl(tmp_path, "train", rows)
    # mlx-lm crashes on empty text; here it is an example with nothing to learn (test_data_checks.py).
    with pytest.raises(ValueError, match=r"train\.jsonl:3: 'text' is empty"):
        load_split(path, tok)
    ds = load_split(path, tok, skip_empty=True, warn=lambda _m: None)
    ref = mlx_datasets.TextDataset(rows[:2] + rows[3:], tok)
    got = as_lists(ds)
    assert got == [ref.process(r) for r in rows[:2] + rows[3:]]
    assert ds.format == "text" and ds.name == "train"
    assert ds.tokens.dtype == np.int32 and ds.lengths.dtype == np.int32
    assert ds.num_tokens == sum(len(t) for t, _ in got)


@pytest.mark.parametrize("mask", [False, True])
def test_completions_match_mlx_lm(tmp_path, tok, mask):
    rows = completion_rows(12)
    ds = load_split(write_jsonl(tmp_path, "train", rows), tok, mask_prompt=mask)
    ref = mlx_datasets.CompletionsDataset(rows, tok, "prompt", "completion", mask)
    assert as_lists(ds) == [ref.process(r) for r in rows]
    assert ds.format == "completions"
    if mask:
        for i, row in enumerate(rows):
            prompt = tok.apply_chat_template(
                [{"role": "user", "content": row["prompt"]}],
                tools=row.get("tools"),
                add_generation_prompt=True,
                return_dict=False,
            )
            assert ds.offsets[i] == len(prompt) > 0
            assert ds[i][0][: len(prompt)].tolist() == prompt
    else:
        assert not ds.offsets.any()


@pytest.mark.parametrize("mask", [False, True])
def test_chat_matches_mlx_lm(tmp_path, tok, mask):
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "and 3+3?"},
                {"role": "assistant", "content": "6"},
            ],
            "tools": TOOLS,
        },
        # Last turn from the user: no generation prompt in the masked prefix.
        {"messages": [{"role": "assistant", "content": "ask me"}, {"role": "user", "content": "ok"}]},
    ]
    ds = load_split(write_jsonl(tmp_path, "valid", rows), tok, mask_prompt=mask)
    ref = mlx_datasets.ChatDataset(rows, tok, mask_prompt=mask)
    assert as_lists(ds) == [ref.process(r) for r in rows]
    assert ds.format == "chat" and ds.name == "valid"


def test_custom_feature_names(tmp_path, tok):
    feats = Features(
        prompt_feature="q", completion_feature="a", text_feature="body", chat_feature="conv"
    )
    comp = load_split(
        write_jsonl(tmp_path, "c", [{"q": "hi", "a": "yo"}]), tok, mask_prompt=True, features=feats
    )
    ref = mlx_datasets.CompletionsDataset([], tok, "q", "a", True)
    assert as_lists(comp) == [ref.process({"q": "hi", "a": "yo"})]
    conv = {"conv": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}]}
    chat = load_split(write_jsonl(tmp_path, "m", [conv]), tok, features=feats)
    assert as_lists(chat) == [mlx_datasets.ChatDataset([], tok, chat_key="conv").process(conv)]
    text = load_split(write_jsonl(tmp_path, "t", [{"body": "zz"}]), tok, features=feats)
    assert as_lists(text) == [mlx_datasets.TextDataset([], tok, text_key="body").process({"body": "zz"})]


def test_blank_lines_are_skipped_but_counted(tmp_path, tok):
    path = write_jsonl(tmp_path, "train", ['{"text": "a"}', "", '{"text": "b"}', "  ", '{"oops": 1}'])
    with pytest.raises(ValueError, match=r"train\.jsonl:5: expected key 'text' like line 1"):
        load_split(path, tok)


BAD_INPUTS = [
    (
        [{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": "c"}, {"prompt": "p", "answer": "c"}],
        False,
        r"train\.jsonl:3: expected keys 'prompt' and 'completion' like line 1, got \['answer', 'prompt'\]",
    ),
    (
        [{"text": "a"}, {"messages": [{"role": "user", "content": "x"}]}],
        False,
        r"train\.jsonl:2: expected key 'text' like line 1, got \['messages'\]",
    ),
    ([{"text": "a"}, '{"text": "b",}'], False, r"train\.jsonl:2: invalid JSON \(.* at column 14\); write exactly "
                                                r"one JSON object per line"),
    # A line cut short is reported where it ends, not at the newline ("column 1").
    ([{"text": "a"}, '{"prompt": "What is 12 + 30?", "completion": "4'], False,
     r"train\.jsonl:2: invalid JSON \(the line ends at column 47 inside the object: cut short\?\)"),
    ([{"text": "a"}, '{"prompt": "What is 12 + 30?", "completion": "42", '], False,
     r"train\.jsonl:2: invalid JSON \(the line ends at column 51 inside the object: cut short\?\)"),
    ([{"text": "a"}, "[1, 2]"], False, r"train\.jsonl:2: expected a JSON object, got a JSON list"),
    ([{"question": "a"}], False, r"train\.jsonl:1: unrecognised format, got keys \['question'\]"),
    ([{"text": "a"}], True, r"train\.jsonl:1: mask_prompt needs .* turn off mask_prompt"),
    ([{"text": "a"}, {"text": 3}], False, r"train\.jsonl:2: 'text' must be a string, got int"),
    ([{"messages": []}], False, r"train\.jsonl:1: 'messages' must be a non-empty list"),
    ([{"messages": [{"content": "x"}]}], False, r"train\.jsonl:1: message 0 of 'messages' must be an object with a 'role'"),
    ([], False, r"train\.jsonl: file is empty"),
    (["", "   "], False, r"train\.jsonl: file is empty"),
]


@pytest.mark.parametrize("rows,mask,pattern", BAD_INPUTS)
def test_bad_input_names_file_and_line(tmp_path, tok, rows, mask, pattern):
    path = write_jsonl(tmp_path, "train", rows)
    with pytest.raises(ValueError, match=pattern) as info:
        load_split(path, tok, mask_prompt=mask)
    assert "\n" not in str(info.value)
    assert str(path) in str(info.value)


def test_prompt_not_prefix_is_an_error(tmp_path):
    bad = make_tokenizer(BAD_TEMPLATE)
    path = write_jsonl(tmp_path, "train", [{"prompt": "a", "completion": "b"}] * 3)
    assert len(load_split(path, bad)) == 3  # fine without masking
    with pytest.raises(ValueError, match=r"train\.jsonl:1: with mask_prompt the prompt's .* not a prefix"):
        load_split(path, bad, mask_prompt=True)


def test_template_failure_names_line(tmp_path, tok):
    notemplate = make_tokenizer()
    notemplate.chat_template = None
    path = write_jsonl(tmp_path, "train", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(ValueError, match=r"train\.jsonl:1: the tokenizer's chat template failed"):
        load_split(path, notemplate)


def test_load_datasets(tmp_path, tok):
    with pytest.raises(ValueError, match=r"nope: data folder not found; point --data at a folder"):
        load_datasets(tmp_path / "nope", tok)
    write_jsonl(tmp_path, "train", completion_rows(4))
    with pytest.raises(ValueError, match=r"valid\.jsonl: not found; create valid\.jsonl in .* per line$"):
        load_datasets(tmp_path, tok)
    ways_out = {"valid": "turn off validation with --val-batches 0", "test": "leave out --test"}
    with pytest.raises(ValueError, match=r"valid\.jsonl in .* per line \(or turn off validation with "
                                         r"--val-batches 0\)$"):  # the caller's way out, offered
        load_datasets(tmp_path, tok, ways_out=ways_out)
    (tmp_path / "valid.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"valid\.jsonl: .*; add one JSON object per line$"):
        load_datasets(tmp_path, tok)
    with pytest.raises(ValueError, match=r"; add one JSON object per line, or turn off validation with "
                                         r"--val-batches 0$"):
        load_datasets(tmp_path, tok, ways_out=ways_out)
    write_jsonl(tmp_path, "valid", completion_rows(2, seed=1))
    ds = load_datasets(tmp_path, tok, mask_prompt=True)
    assert (len(ds.train), len(ds.valid), ds.test) == (4, 2, None)
    assert ds.train.offsets.all()
    with pytest.raises(ValueError, match=r"test\.jsonl: not found"):
        load_datasets(tmp_path, tok, need_test=True)
    only_valid = load_datasets(tmp_path, tok, need_train=False)
    assert only_valid.train is None and len(only_valid.valid) == 2


@pytest.mark.skipif(not (TINY_LLAMA / "tokenizer_config.json").exists(), reason="no tiny-llama asset")
def test_real_tokenizer_matches_mlx_lm(tmp_path):
    real = transformers.AutoTokenizer.from_pretrained(str(TINY_LLAMA))
    if getattr(real, "chat_template", None) is None:
        pytest.skip("tiny-llama tokenizer has no chat template")
    rows = completion_rows(5)
    ds = load_split(write_jsonl(tmp_path, "train", rows), real, mask_prompt=True)
    ref = mlx_datasets.CompletionsDataset(rows, real, "prompt", "completion", True)
    assert as_lists(ds) == [ref.process(r) for r in rows]


# --------------------------------------------------------------- batches


def synthetic(n: int = 50, seed: int = 0, hi: int = 100, name: str = "train") -> TokenizedDataset:
    rng = np.random.default_rng(seed)
    lens = rng.integers(2, hi, size=n)
    examples = [(rng.integers(1, 90, size=k), int(rng.integers(0, k))) for k in lens]
    return TokenizedDataset.from_examples(name, examples)


def np_batch(b: Batch):
    return np.array(b.tokens), np.array(b.lengths)


def take(it, k):
    return [np_batch(next(it)) for _ in range(k)]


def same(xs, ys):
    return len(xs) == len(ys) and all(
        np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(xs, ys)
    )


def test_batches_sorted_padded_and_exact():
    ds = synthetic(50)
    it = BatchIterator(ds, batch_size=4, max_seq_length=2048, loop=False)
    assert len(it) == it.batches_per_epoch == 12  # 50 // 4, tail of 2 dropped
    order = np.argsort(ds.lengths, kind="stable")
    prev_max = 0
    for k, batch in enumerate(it):
        assert isinstance(batch, Batch)
        assert batch.tokens.dtype == mx.int32 and batch.lengths.dtype == mx.int32
        tokens, lengths = np_batch(batch)
        rows = order[4 * k : 4 * k + 4]
        assert np.array_equal(it.batch_indices[k], rows)
        width = tokens.shape[1]
        assert (width - 1) % 32 == 0 and width - 1 >= ds.lengths[rows].max() > width - 33
        for j, i in enumerate(rows):
            toks, off = ds[i]
            assert np.array_equal(tokens[j, : len(toks)], toks)
            assert not tokens[j, len(toks):].any()
            assert tuple(lengths[j]) == (off, len(toks))
        assert ds.lengths[rows].min() >= prev_max
        prev_max = ds.lengths[rows].max()
    assert k == 11


def test_padded_width_widens_to_the_inputs_multiple_where_it_costs_little_and_fits_the_cap():
    assert padded_width(1024, pad_to=32, max_seq_length=1024) == 1024  # mlx-lm's: 1023 model inputs
    assert padded_width(1024, pad_to=32, max_seq_length=1024, inputs_multiple_of=128) == 1025
    assert padded_width(990, pad_to=32, max_seq_length=2048, inputs_multiple_of=128) == 1025  # 992 + 32
    assert padded_width(860, pad_to=32, max_seq_length=2048, inputs_multiple_of=128) == 897  # 864 + 32
    assert padded_width(470, pad_to=32, max_seq_length=2048, inputs_multiple_of=128) == 481  # 480 + 32 is > 1/16
    assert padded_width(896, pad_to=32, max_seq_length=2048, inputs_multiple_of=128) == 897  # already 7 x 128
    assert padded_width(90, pad_to=32, max_seq_length=1024, inputs_multiple_of=128) == 97  # 96 + 32: 1/3 more
    assert padded_width(4096, pad_to=32, max_seq_length=4096, inputs_multiple_of=128) == 4097
    assert padded_width(1880, pad_to=32, max_seq_length=4096, inputs_multiple_of=128) == 1921  # 1888 + 32
    assert padded_width(1000, pad_to=32, max_seq_length=1000, inputs_multiple_of=128) == 1000  # 1024 > 1000 inputs


@pytest.mark.parametrize("pack", [False, True])
def test_an_inputs_multiple_only_adds_padding_columns(pack):
    ds = synthetic(40, hi=120)
    msl, multiple = 64, 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TruncationWarning)
        plain = list(BatchIterator(ds, batch_size=4, max_seq_length=msl, loop=False, pack=pack))
        wide = list(BatchIterator(ds, batch_size=4, max_seq_length=msl, loop=False, pack=pack,
                                  inputs_multiple_of=multiple))
    assert len(plain) == len(wide) > 0
    capped = 0
    for a, b in zip(map(np_batch, plain), map(np_batch, wide)):
        width = a[0].shape[1]
        capped += width == msl
        assert (b[0].shape[1] - 1) % multiple == 0 and width <= b[0].shape[1] < width + multiple
        assert np.array_equal(b[0][:, :width], a[0]) and not b[0][:, width:].any()
        assert np.array_equal(b[1], a[1])
    assert capped  # the cap was met, and passed


def test_truncation_warns_once_with_count():
    ds = synthetic(40, hi=120)
    msl = 64
    n_long = int((ds.lengths[np.argsort(ds.lengths, kind="stable")[:40]] > msl).sum())
    assert n_long > 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        it = BatchIterator(ds, batch_size=8, max_seq_length=msl, seed=1)
        batches = take(it, 3 * len(it))
    msgs = [str(w.message) for w in caught if issubclass(w.category, TruncationWarning)]
    assert len(msgs) == 1
    assert msgs[0].startswith(f"train: {n_long} of 40 examples exceed max_seq_length=64 and will be truncated")
    for tokens, lengths in batches:
        assert tokens.shape[1] <= msl and lengths[:, 1].max() <= msl
    seen = []
    BatchIterator(ds, batch_size=8, max_seq_length=2048, warn=seen.append)
    assert seen == []
    BatchIterator(ds, batch_size=8, max_seq_length=msl, warn=seen.append)
    assert len(seen) == 1 and seen[0] == msgs[0]


def test_rank_sharding_partitions_global_batches():
    ds = synthetic(64)
    full = BatchIterator(ds, batch_size=8, max_seq_length=2048, seed=3)
    ranks = [BatchIterator(ds, batch_size=8, max_seq_length=2048, seed=3, rank=r, world_size=2) for r in range(2)]
    assert all(r.local_batch_size == 4 for r in ranks)
    assert all(len(r) == len(full) for r in ranks)
    for _ in range(2 * len(full)):
        g_tok, g_len = np_batch(next(full))
        parts = [np_batch(next(r)) for r in ranks]
        # mlx-lm's idx[i + r : i + batch_size : W]: rank r holds rows r, r+W, ...
        for r, (t, l) in enumerate(parts):
            rows = np.arange(r, 8, 2)
            n = min(t.shape[1], g_tok.shape[1])
            assert np.array_equal(t[:, :n], g_tok[rows, :n])
            assert not t[:, n:].any() and not g_tok[rows, n:].any()
            assert np.array_equal(l, g_len[rows])
    idx = np.concatenate([r.batch_indices for r in ranks], axis=1)
    assert np.array_equal(np.sort(idx, axis=1), np.sort(full.batch_indices, axis=1))


def test_shuffle_is_deterministic_by_seed():
    ds = synthetic(80)
    def epoch_sigs(seed, epochs=2):
        it = BatchIterator(ds, batch_size=4, max_seq_length=2048, seed=seed)
        return [np_batch(next(it))[0].tobytes() for _ in range(epochs * len(it))]
    a, b, c = epoch_sigs(0), epoch_sigs(0), epoch_sigs(1)
    n = len(a) // 2
    assert a == b and a != c
    assert a[:n] != a[n:]  # a new order each epoch
    assert sorted(a[:n]) == sorted(a[n:]) == sorted(c[:n])  # each epoch visits every batch once


@pytest.mark.parametrize("stop", [0, 5, 19, 20, 23, 45])
def test_cursor_resume_yields_identical_batches(stop):
    ds = synthetic(80)  # 20 batches per epoch
    kw = dict(batch_size=4, max_seq_length=2048, seed=7)
    ref = BatchIterator(ds, **kw)
    expected = take(ref, stop + 30)
    first = BatchIterator(ds, **kw)
    take(first, stop)
    state = json.loads(json.dumps(first.state()))
    assert state["epoch"] == stop // 20 and state["position"] == stop % 20
    resumed = BatchIterator(ds, **kw)
    resumed.load_state(state)
    assert same(take(resumed, 30), expected[stop:])


def test_cursor_is_rank_independent():
    ds = synthetic(80)
    single = BatchIterator(ds, batch_size=4, max_seq_length=2048, seed=2)
    take(single, 27)
    state = single.state()
    expected = take(single, 5)
    ranks = [BatchIterator(ds, batch_size=4, max_seq_length=2048, seed=2, rank=r, world_size=2) for r in range(2)]
    for r in ranks:
        r.load_state(state)
    for tokens, lengths in expected:
        (t0, l0), (t1, l1) = (np_batch(next(r)) for r in ranks)
        assert np.array_equal(l0, lengths[0::2]) and np.array_equal(l1, lengths[1::2])
        # The rows themselves, not only their lengths (a shard may pad to its own longest row).
        for t, rows in ((t0, tokens[0::2]), (t1, tokens[1::2])):
            n = min(t.shape[1], rows.shape[1])
            assert np.array_equal(t[:, :n], rows[:, :n]) and not t[:, n:].any() and not rows[:, n:].any()


def test_bad_cursor_and_options():
    ds = synthetic(20, name="valid")
    it = BatchIterator(ds, batch_size=4, max_seq_length=2048, seed=1)
    with pytest.raises(ValueError, match=r"valid: batch cursor .* lacks integer 'epoch'"):
        it.load_state({"position": 1})
    with pytest.raises(ValueError, match=r"valid: batch cursor was saved with 9 batches per epoch"):
        it.load_state({"epoch": 0, "position": 1, "batches_per_epoch": 9})
    with pytest.raises(ValueError, match=r"resume with seed=5"):
        it.load_state({"epoch": 0, "position": 1, "seed": 5})
    with pytest.raises(ValueError, match=r"position=5 is out of range"):
        it.load_state({"epoch": 0, "position": 5})
    with pytest.raises(ValueError, match=r"valid: has 20 examples, fewer than batch_size=32; add examples, "
                                         r"give --batch-size 20 \(or less\)$"):
        BatchIterator(ds, batch_size=32, max_seq_length=2048)
    with pytest.raises(ValueError, match=r"give --batch-size 20 \(or less\), or leave out --test$"):  # the caller's
        BatchIterator(ds, batch_size=32, max_seq_length=2048, way_out="leave out --test")
    with pytest.raises(ValueError, match=r"valid: batch_size=6 is not divisible by world_size=4"):
        BatchIterator(ds, batch_size=6, max_seq_length=2048, world_size=4)
    with pytest.raises(ValueError, match=r"rank=2 must be in 0..world_size-1"):
        BatchIterator(ds, batch_size=4, max_seq_length=2048, rank=2, world_size=2)


def test_loop_false_yields_each_batch_once_and_restarts():
    ds = synthetic(30)
    it = BatchIterator(ds, batch_size=4, max_seq_length=2048, loop=False)
    first = [np_batch(b) for b in it]
    assert len(first) == len(it) == 7
    assert next(iter(it), None) is not None  # a finished pass restarts
    again = [np_batch(b) for b in BatchIterator(ds, batch_size=4, max_seq_length=2048, loop=False)]
    assert same(first, again)
    shuffled = [np_batch(b) for b in BatchIterator(ds, batch_size=4, max_seq_length=2048, loop=False, shuffle=True)]
    assert sorted(t.tobytes() for t, _ in shuffled) == sorted(t.tobytes() for t, _ in first)
    looping = BatchIterator(ds, batch_size=4, max_seq_length=2048, shuffle=False)
    epoch = take(looping, len(looping))
    assert len(looping) == 8 and same(epoch[:7], first)  # training completes the last batch (fill_last)
    assert same(take(looping, 8), epoch)


class FakeGroup:
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("world,msl", [(1, 2048), (2, 2048), (1, 40), (2, 40)])
def test_batches_equal_mlx_lm_iterate_batches(tmp_path, tok, monkeypatch, world, msl):
    rows = completion_rows(37, seed=5)
    ds = load_split(write_jsonl(tmp_path, "train", rows), tok, mask_prompt=True)
    ref_ds = mlx_datasets.CompletionsDataset(rows, tok, "prompt", "completion", True)
    # mlx-lm's own processed examples, as a plain list so it sorts by token length.
    ref_examples = [ref_ds.process(r) for r in rows]
    # mlx-lm always permutes batch order; pin it to identity to compare sorted order.
    monkeypatch.setattr(np.random, "permutation", lambda n: np.arange(n))
    for rank in range(world):
        group = FakeGroup(rank, world) if world > 1 else None
        expected = [
            (np.array(b), np.array(l))
            for b, l in mlx_trainer.iterate_batches(ref_examples, 8, msl, comm_group=group)
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TruncationWarning)
            ours = BatchIterator(ds, batch_size=8, max_seq_length=msl, rank=rank, world_size=world, loop=False)
        assert same([np_batch(b) for b in ours], expected)
        assert len(expected) == 4


def test_empty_completion_is_an_error(tmp_path, tok):
    path = write_jsonl(tmp_path, "train", [{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": " "}])
    with pytest.raises(ValueError, match=r"train\.jsonl:2: 'completion' is empty"):
        load_split(path, tok)


def test_non_utf8_names_line_and_byte(tmp_path, tok):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"train\.jsonl:2: not UTF-8 text \(byte 0xe9 at column 14\)"):
        load_split(path, tok)


def test_too_long_is_an_error_only_when_asked(tmp_path, tok):
    path = write_jsonl(tmp_path, "train", [{"text": "a"}, {"text": "x" * 50}])
    assert len(load_split(path, tok)) == 2  # default: the batcher truncates and warns
    with pytest.raises(ValueError, match=r"train\.jsonl:2: example is \d+ tokens, longer than "
                                         r"data\.max_seq_length=8; .*data\.truncate true"):
        load_split(path, tok, max_length=8)


def numbered(n: int, seed: int = 0) -> TokenizedDataset:
    """Like synthetic(), but the first token of example i is 1000 + i: a batch row names its example."""
    rng = np.random.default_rng(seed)
    examples = [(np.concatenate([[1000 + i], rng.integers(1, 90, size=k - 1)]), int(rng.integers(0, k)))
                for i, k in enumerate(rng.integers(2, 100, size=n))]
    return TokenizedDataset.from_examples("train", examples)


def examples_in(batch: Batch) -> list[int]:
    """The examples a batch holds, by their first token (numbered()); a packed row holds several."""
    tokens, lengths = np_batch(batch)
    if lengths.ndim == 2:
        return [int(t) - 1000 for t in tokens[:, 0]]
    return [int(tokens[b, start]) - 1000 for b in range(tokens.shape[0]) for start, _, end in lengths[b] if end]


@pytest.mark.parametrize("n, batch_size, world, pack", [
    (43, 8, 1, False), (43, 8, 2, False), (50, 4, 2, False), (7, 4, 2, False), (101, 6, 3, False),
    (43, 4, 1, True), (43, 4, 2, True)])
def test_every_example_is_trained_each_epoch_with_the_shortest_completing_the_last_batch(n, batch_size, world, pack):
    ds = numbered(n)
    said: list[str] = []
    ranks = [BatchIterator(ds, batch_size=batch_size, max_seq_length=128 if pack else 2048, seed=3, rank=r,
                           world_size=world, pack=pack, warn=said.append) for r in range(world)]
    units = len(ranks[0].rows) if pack else n
    assert units % batch_size  # the split does not divide into batches
    assert all(len(r) == -(-units // batch_size) for r in ranks)  # every rank the same count: full batches
    order = np.argsort(ds.lengths, kind="stable")
    for _ in range(2):
        epoch: list[int] = []
        for _ in range(len(ranks[0])):
            shares = [next(r) for r in ranks]
            assert sum(b.tokens.shape[0] for b in shares) == batch_size  # a global batch, whole
            epoch += [i for b in shares for i in examples_in(b)]
        assert sorted(set(epoch)) == list(range(n))  # every example, the longest included
        if not pack:  # the repeats are the shortest, the ones the first batch holds
            repeated = sorted(i for i in set(epoch) if epoch.count(i) > 1)
            assert len(epoch) == len(ranks[0]) * batch_size and repeated == sorted(order[:len(epoch) - n].tolist())
    assert said == []  # nothing is left out, so nothing to say


def test_one_pass_keeps_mlx_lm_s_complete_batches_unless_told_to_fill():
    ds = numbered(43)
    order = np.argsort(ds.lengths, kind="stable")
    kept = [i for b in BatchIterator(ds, batch_size=8, max_seq_length=2048, loop=False) for i in examples_in(b)]
    assert sorted(kept) == sorted(order[:40].tolist())  # evaluation: the 3 longest are not in a full batch
    filled = BatchIterator(ds, batch_size=8, max_seq_length=2048, loop=False, fill_last=True)
    assert [examples_in(b) for b in filled][-1] == [*order[:5].tolist(), *order[40:].tolist()]


@pytest.mark.parametrize("world", [1, 2])
def test_a_cursor_resumes_across_the_epoch_boundary_and_the_completed_batch(world):
    ds = numbered(43)  # 5 full batches of 8; the sixth holds the 3 longest and the 5 shortest
    kw = dict(batch_size=8, max_seq_length=2048, seed=7)
    single = BatchIterator(ds, **kw)
    n = len(single)
    assert n == 6
    # Where epochs 0 and 1 visit the completed batch (index n - 1 in sorted order).
    at = [int(np.flatnonzero(single.epoch_order(e) == n - 1)[0]) for e in range(2)]
    longest = set(np.argsort(ds.lengths, kind="stable")[40:].tolist())
    for stop in (at[0], n - 1, n, n + at[1]):
        saved = BatchIterator(ds, **kw)  # saved on one rank, resumed on `world`: the cursor counts global batches
        take(saved, stop)
        state = json.loads(json.dumps(saved.state()))
        for rank in range(world):
            reference = take(BatchIterator(ds, rank=rank, world_size=world, **kw), 3 * n)
            resumed = BatchIterator(ds, rank=rank, world_size=world, **kw)
            resumed.load_state(state)
            assert same(take(resumed, 3 * n - stop), reference[stop:])
        if stop in (at[0], n + at[1]):  # the next batch is the completed one: the longest examples train
            resumed = BatchIterator(ds, **kw)
            resumed.load_state(state)
            assert longest <= set(examples_in(next(resumed)))


def test_a_cursor_of_changed_data_is_refused_unless_told():
    ds = synthetic(40)
    it = BatchIterator(ds, batch_size=8, max_seq_length=4096)
    take(it, 3)
    cursor = it.state()
    assert BatchIterator(synthetic(40), batch_size=8, max_seq_length=4096).digest == cursor["digest"]
    changed = TokenizedDataset(name="train", path=None, format="tokens", tokens=ds.tokens.copy(), starts=ds.starts,
                               lengths=ds.lengths, offsets=ds.offsets)
    changed.tokens[5] += 1  # one token, same row count and lengths
    other = BatchIterator(changed, batch_size=8, max_seq_length=4096)
    with pytest.raises(ValueError, match=r"--resume: the train data is not the data the checkpoint was trained on.*"
                                         r"give --data\.changed_ok true"):
        other.load_state(cursor)
    other.load_state(cursor, changed_ok=True)
    assert other.state()["position"] == cursor["position"]
    other.load_state({k: v for k, v in cursor.items() if k != "digest"})  # a cursor saved before digests: taken
