"""Tokenized splits kept on disk, so a split is tokenized once per file, tokenizer and settings.

Tokenizing runs every row through the chat template (twice with mask_prompt), and every rank of a
run does it for the whole file (what that costs: docs/performance.md, "Data"). `cached_split` saves
a split once under a key that hashes everything its tokens depend on (`split_key`): any change is
another key, so a stale entry is never read, only left behind, and the folder (`cache_dir`) can be
deleted at any time. A cache that cannot be written or read costs the time of tokenizing, nothing else.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from .dataset import TokenizedDataset

CACHE_ENV = "MESHTUNE_CACHE_DIR"
# 2: entries hold the rows data.skip_empty left out; 3: the shared system prompt; 4: the chat rows without a reply
VERSION = b"meshtune-tokens-4"
# Keys of the tokenizer's init_kwargs that name where it was read from, not what it does.
_PLACE_KEYS = {"name_or_path", "vocab_file", "tokenizer_file", "is_local", "local_files_only", "_commit_hash"}


def cache_dir() -> Optional[Path]:
    """Where tokenized splits are kept, or None when the cache is turned off (MESHTUNE_CACHE_DIR=off).

    $MESHTUNE_CACHE_DIR, else $XDG_CACHE_HOME/meshtune, else ~/.cache/meshtune, under tokens/.
    """
    where = os.environ.get(CACHE_ENV)
    if where is not None:
        return None if where.strip().lower() in ("", "off", "0", "false", "none") else Path(where) / "tokens"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "meshtune" / "tokens"


def _ordered(value: Any) -> str:
    return repr(sorted(value)) if isinstance(value, (set, frozenset, list, tuple)) else repr(value)


def tokenizer_fingerprint(tokenizer: Any) -> Optional[str]:
    """A digest of everything in `tokenizer` that decides its tokens, or None where that cannot be told
    (a tokenizer without a serialisable fast backend is never cached)."""
    # mlx-lm's TokenizerWrapper holds the Hugging Face tokenizer as _tokenizer (which has its own
    # _tokenizer, the Rust one: so unwrap only what lacks a backend itself).
    inner = tokenizer if hasattr(tokenizer, "backend_tokenizer") else getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(inner, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    try:
        import transformers

        settings = {k: v for k, v in getattr(inner, "init_kwargs", {}).items() if k not in _PLACE_KEYS}
        parts = [type(inner).__name__, transformers.__version__, backend.to_str(),
                 repr(getattr(inner, "chat_template", None)), repr(getattr(inner, "special_tokens_map", None)),
                 repr(getattr(tokenizer, "eos_token_id", None)), _ordered(getattr(tokenizer, "eos_token_ids", None)),
                 repr(sorted(settings.items(), key=lambda kv: kv[0]))]
    except Exception:  # an exotic tokenizer: tokenize every time rather than guess
        return None
    text = "\0".join(parts)
    if " object at 0x" in text:  # a repr with an address would change every run
        return None
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """A digest of meshtune's tokenizing code: a change to how rows become tokens is a new key."""
    here = Path(__file__).parent
    names = ("formats.py", "checks.py", "hf.py", "token_cache.py")
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in names)).hexdigest()


def split_key(path: Optional[Path], tokenizer: Any, options: str,
              content: Optional[Callable[[Any], None]] = None) -> Optional[str]:
    """The cache key of tokenizing `path` (or the rows `content` feeds a hash) with `tokenizer` and
    `options`, or None (not cached).

    It hashes everything the tokens depend on: the file's bytes, the tokenizer (its whole serialised
    model, chat template, special tokens and settings), the format options, max_seq_length,
    skip_empty, the transformers version and meshtune's own tokenizing code (formats.py, checks.py,
    hf.py, this file). A split read through the datasets library (hf.py) is keyed on its Arrow
    buffers and selected rows (`content`) in place of a file's bytes.
    """
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint is None:
        return None
    digest = hashlib.sha256(VERSION)
    for part in (_code_digest().encode(), fingerprint.encode(), options.encode()):
        digest.update(len(part).to_bytes(8, "little") + part)
    if content is not None:
        content(digest)
        return digest.hexdigest()
    with open(path, "rb") as fid:
        for block in iter(lambda: fid.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read(entry: Path, name: str, path: Optional[Path]) -> Optional[TokenizedDataset]:
    try:
        with np.load(entry, allow_pickle=False) as saved:
            skipped = tuple(zip(saved["skipped_lines"].tolist(), saved["skipped_why"].tolist()))
            return TokenizedDataset(name=name, path=path, format=str(saved["format"]), tokens=saved["tokens"],
                                    starts=saved["starts"], lengths=saved["lengths"], offsets=saved["offsets"],
                                    skipped=skipped, system_prompt=str(saved["system_prompt"][0])
                                    if saved["system_prompt"].size else None,
                                    no_reply=tuple(saved["no_reply_lines"].tolist()))
    except Exception:  # missing, partial or foreign: tokenize again
        return None


def _write(entry: Path, data: TokenizedDataset) -> None:
    """Save `data` whole under a temporary name, then rename it into place: ranks writing the same entry
    at once, or a run killed mid-write, leave a complete entry or none. The rows skip_empty left out and
    the chat rows without a reply are kept with the tokens, so a split read back warns about them as one
    tokenized does."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=entry.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fid:
                lines = np.array([line for line, _ in data.skipped], dtype=np.int64)
                whys = np.array([why for _, why in data.skipped], dtype=np.str_)
                np.savez(fid, format=np.array(data.format), tokens=data.tokens, starts=data.starts,
                         lengths=data.lengths, offsets=data.offsets, skipped_lines=lines, skipped_why=whys,
                         system_prompt=np.array([] if data.system_prompt is None else [data.system_prompt],
                                                dtype=np.str_),
                         no_reply_lines=np.array(data.no_reply, dtype=np.int64))
            os.replace(tmp, entry)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:  # a read-only or full disk: the run goes on with what it tokenized
        pass


def cached_split(path: Optional[Path], tokenizer: Any, options: str, tokenize: Callable[[], TokenizedDataset], *,
                 content: Optional[Callable[[Any], None]] = None, name: Optional[str] = None) -> TokenizedDataset:
    """`tokenize()`'s dataset for `path` (or, without one, the rows `content` digests, named `name`),
    read from the cache where an entry with this key exists."""
    where = cache_dir()
    key = split_key(path, tokenizer, options, content) if where is not None else None
    if key is None:
        return tokenize()
    entry = where / f"{key}.npz"
    data = _read(entry, name or path.stem, path)
    if data is None:
        data = tokenize()
        _write(entry, data)
    return data
