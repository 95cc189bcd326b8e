"""Shared fixtures: tiny models built in code, the embedded assets, a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

# The tests compare float32 algebra against references at 1e-4 or tighter; MLX's CUDA
# build multiplies float32 in TF32 (10-bit mantissa) unless told otherwise. Read once,
# before the first matmul; no effect on the CPU.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
# Tokenized splits are cached (meshtune/data/token_cache.py): here in one folder for the session, shared by
# every test and the processes they start, and not the user's own cache.
_CACHE = tempfile.TemporaryDirectory(prefix="meshtune-test-cache-")
os.environ["MESHTUNE_CACHE_DIR"] = _CACHE.name

import mlx.core as mx  # noqa: E402
import pytest

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "meshtune" / "assets"
TINY_MODEL = ASSETS / "tiny-llama"
ARITH_DATA = ASSETS / "data" / "arithmetic"


def tiny_llama(layers: int = 2, dim: int = 32, vocab: int = 64, tied: bool = True, seed: int = 0):
    """A small random Llama built from mlx-lm's own model code."""
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs(model_type="llama", hidden_size=dim, num_hidden_layers=layers,
                           intermediate_size=2 * dim, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=vocab, tie_word_embeddings=tied)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.fixture
def model_factory():
    return tiny_llama


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m meshtune.cli ARGS` in a fresh process, output captured."""
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(ROOT))
    return subprocess.run([sys.executable, "-m", "meshtune.cli", *args], cwd=cwd or ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli
