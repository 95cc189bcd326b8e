"""What the tests share: tiny models built in code, the embedded assets, a CLI runner.

Imported by tests/conftest.py (which sets the environment first) and by tests and rank workers as
`from support import ...` (tests/ is on the path: pytest puts the root conftest's folder there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

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



def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m meshtune.cli ARGS` in a fresh process, output captured."""
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(ROOT))
    return subprocess.run([sys.executable, "-m", "meshtune.cli", *args], cwd=cwd or ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_bench_json(*args: str, timeout: int = 600) -> tuple[list[str], dict]:
    """`meshtune bench ARGS --json`, which must exit 0: (the lines before the JSON, the JSON object)."""
    proc = run_cli("bench", *args, "--json", timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    return lines[:-1], json.loads(lines[-1])


# A stand-in `ssh` for `meshtune launch --hostfile`: no remote host is reachable here, so it logs the host
# it was asked for and runs the remote command locally with a cleared environment (as sshd would: only
# what the command line sets reaches the rank), in a session of its own (on a real host no signal to the
# local ssh client reaches it). The launcher's code path (hostfile, remote script, pid line, remote kill)
# is the real one.
FAKE_SSH = """#!/bin/sh
host="$1"; shift
echo "$host $*" >> "{log}"
exec setsid -w env -i PATH="$PATH" HOME="$HOME" /bin/sh -c "$*"
"""


def fake_ssh(folder: Path, environ: dict[str, str]) -> dict[str, str]:
    """`environ` with FAKE_SSH first on PATH; it logs each call to folder/ssh.log."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    ssh = bin_dir / "ssh"
    ssh.write_text(FAKE_SSH.format(log=folder / "ssh.log"))
    ssh.chmod(0o755)
    return dict(environ, PATH=f"{bin_dir}{os.pathsep}{environ.get('PATH', os.environ['PATH'])}")
