"""Tokenized splits cached on disk (meshtune/data/token_cache.py): read back only for the same file bytes,
tokenizer and options; off, broken or unwritable caches cost time, never results."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from meshtune.data import formats, load_split, token_cache
from meshtune.data.token_cache import CACHE_ENV, tokenizer_fingerprint

pytest.importorskip("tokenizers")
from test_data import BAD_TEMPLATE, completion_rows, make_tokenizer, write_jsonl  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    where = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(where))
    return where / "tokens"


@pytest.fixture
def tokenized(monkeypatch):
    """How many rows were tokenized (not read from the cache) since the test began."""
    calls = []
    real = formats.tokenize_row

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(formats, "tokenize_row", counting)
    return calls


def _same(a, b):
    assert (a.name, a.format, len(a)) == (b.name, b.format, len(b))
    for field in ("tokens", "starts", "lengths", "offsets"):
        got, want = getattr(a, field), getattr(b, field)
        assert got.dtype == want.dtype and np.array_equal(got, want), field


def test_a_split_is_tokenized_once_then_read_back(tmp_path, cache, tokenized):
    tok = make_tokenizer()
    path = write_jsonl(tmp_path, "train", completion_rows(12))
    first = load_split(path, tok, mask_prompt=True)
    assert len(tokenized) == 12 and len(list(cache.glob("*.npz"))) == 1
    again = load_split(path, tok, mask_prompt=True)
    assert len(tokenized) == 12  # nothing tokenized the second time
    _same(again, first)
    assert again.path == path


def test_any_change_to_file_tokenizer_or_options_is_another_entry(tmp_path, cache, tokenized):
    tok = make_tokenizer()
    path = write_jsonl(tmp_path, "train", completion_rows(6))
    base = load_split(path, tok, mask_prompt=True)
    # Options: no mask (other offsets), a length limit.
    unmasked = load_split(path, tok, mask_prompt=False)
    assert unmasked.offsets.sum() == 0 and base.offsets.sum() > 0
    load_split(path, tok, mask_prompt=True, max_length=1000)
    # The tokenizer: another chat template renders other tokens.
    other = load_split(path, make_tokenizer(BAD_TEMPLATE), mask_prompt=False)
    assert not np.array_equal(other.tokens, unmasked.tokens)
    assert len(tokenized) == 4 * 6
    # The file: one byte of one row.
    rows = completion_rows(6)
    rows[3]["completion"] += "x"
    write_jsonl(tmp_path, "train", rows)
    changed = load_split(path, tok, mask_prompt=True)
    assert len(tokenized) == 5 * 6
    assert changed.lengths[3] == base.lengths[3] + 1
    assert len(list(cache.glob("*.npz"))) == 5


def test_bad_rows_are_reported_every_time_and_nothing_is_cached(tmp_path, cache):
    tok = make_tokenizer()
    path = write_jsonl(tmp_path, "train", [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": ""}])
    for _ in range(2):
        with pytest.raises(ValueError, match=r"train.jsonl:2: 'completion' is empty"):
            load_split(path, tok)
    assert not cache.exists() or not list(cache.iterdir())


def test_turned_off_nothing_is_written(tmp_path, monkeypatch, tokenized):
    monkeypatch.setenv(CACHE_ENV, "off")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    tok = make_tokenizer()
    path = write_jsonl(tmp_path, "train", completion_rows(4))
    _same(load_split(path, tok), load_split(path, tok))
    assert len(tokenized) == 8 and not (tmp_path / "home").exists()


def test_a_broken_entry_is_tokenized_again_and_replaced(tmp_path, cache, tokenized):
    tok = make_tokenizer()
    path = write_jsonl(tmp_path, "train", completion_rows(5))
    first = load_split(path, tok)
    (entry,) = cache.glob("*.npz")
    entry.write_bytes(entry.read_bytes()[:100])  # cut short, as a full disk would
    _same(load_split(path, tok), first)
    assert len(tokenized) == 10
    _same(load_split(path, tok), first)  # the rewritten entry is read
    assert len(tokenized) == 10 and not list(cache.glob("*.tmp"))


def test_an_unwritable_cache_still_tokenizes(tmp_path, monkeypatch, cache, tokenized):
    cache.parent.mkdir()
    cache.parent.chmod(0o500)
    if os.geteuid() == 0:  # root writes into a read-only folder anyway (the test machines run as root): refuse here
        def refuse(*args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied")

        monkeypatch.setattr(token_cache.tempfile, "mkstemp", refuse)
    tok = make_tokenizer()
    path = write_jsonl(tmp_path, "train", completion_rows(3))
    _same(load_split(path, tok), load_split(path, tok))
    assert len(tokenized) == 6
    assert not cache.exists() or not list(cache.iterdir())  # nothing written, not even a temporary file


def test_an_unwritable_cache_path_still_tokenizes(tmp_path, monkeypatch, tokenized):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(CACHE_ENV, str(blocker))  # tokens/ would go under a file: cannot be made
    tok = make_tokenizer()
    path = write_jsonl(tmp_path, "train", completion_rows(3))
    _same(load_split(path, tok), load_split(path, tok))
    assert len(tokenized) == 6


def test_fingerprint_follows_what_the_tokenizer_does_not_where_it_lives():
    a, b = make_tokenizer(), make_tokenizer()
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b) is not None
    b.eos_token = "<pad>"
    assert tokenizer_fingerprint(b) != tokenizer_fingerprint(a)
    assert tokenizer_fingerprint(object()) is None  # no fast backend: never cached


def test_the_embedded_model_tokenizer_is_cacheable():
    from mlx_lm.utils import load_tokenizer

    from support import TINY_MODEL

    first, second = load_tokenizer(TINY_MODEL), load_tokenizer(TINY_MODEL)
    assert tokenizer_fingerprint(first) == tokenizer_fingerprint(second) is not None
