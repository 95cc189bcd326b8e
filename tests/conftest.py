"""Shared fixtures; the helpers behind them are in support.py."""

from __future__ import annotations

import os
import tempfile

# The tests compare float32 algebra against references at 1e-4 or tighter; MLX's CUDA
# build multiplies float32 in TF32 (10-bit mantissa) unless told otherwise. Read once,
# before the first matmul; no effect on the CPU.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
# Tokenized splits are cached (meshtune/data/token_cache.py): here in one folder for the session, shared by
# every test and the processes they start, and not the user's own cache.
_CACHE = tempfile.TemporaryDirectory(prefix="meshtune-test-cache-")
os.environ["MESHTUNE_CACHE_DIR"] = _CACHE.name

import pytest  # noqa: E402

from support import run_cli, tiny_llama  # noqa: E402


@pytest.fixture
def model_factory():
    return tiny_llama


@pytest.fixture
def cli():
    return run_cli
