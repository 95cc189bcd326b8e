"""MLX's CUDA batch size (runtime/gpu_batches.py): set before MLX loads, only where MLX's default is larger,
never over the user's own value. Each case runs in a fresh interpreter, where MLX is not yet imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshtune.runtime.gpu_batches import OPS_PER_BATCH, VARIABLE

CASE = """
import json, os, sys
from meshtune.runtime import gpu_batches
seen = {}
def major():
    seen["mlx_loaded"] = "mlx.core" in sys.modules
    return MAJOR
gpu_batches.compute_capability_major = major
if IMPORT_MLX:
    import mlx.core
result = RUN
print(json.dumps({"result": result, "value": os.environ.get(gpu_batches.VARIABLE), **seen}))
"""


def _run(major: int | None, *, user_value: str | None = None, import_mlx: bool = False,
         run: str = "gpu_batches.use_smaller_gpu_batches()") -> dict:
    # MESHTUNE_SYSTEM_BLAS=0: the command line's OpenBLAS re-exec would start a process without the stand-in.
    env = {k: v for k, v in os.environ.items() if k != VARIABLE} | {"MESHTUNE_SYSTEM_BLAS": "0"}
    if user_value is not None:
        env[VARIABLE] = user_value
    code = CASE.replace("MAJOR", repr(major)).replace("IMPORT_MLX", repr(import_mlx)).replace("RUN", run)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("major", [9, 10, 12])
def test_a_gpu_where_mlx_batches_100_operations_gets_50(major):
    assert _run(major) == {"result": True, "value": str(OPS_PER_BATCH), "mlx_loaded": False}


@pytest.mark.parametrize("major", [None, 7, 8])
def test_no_gpu_or_an_older_one_keeps_mlx_s_default(major):
    out = _run(major)
    assert out["result"] is False and out["value"] is None


def test_the_user_s_own_value_is_kept():
    out = _run(9, user_value="100")
    assert out["result"] is False and out["value"] == "100"


def test_nothing_is_set_once_mlx_is_loaded():
    """MLX reads the variable when it opens its GPU stream: set later, it would claim a batch size not in use."""
    out = _run(9, import_mlx=True)
    assert out["result"] is False and out["value"] is None


def test_the_command_line_sets_it_before_mlx_loads():
    """`meshtune config` (no MLX) goes through the command line's start as every subcommand does."""
    out = _run(9, run='__import__("meshtune.cli", fromlist=["main"]).main(["config"])')
    assert out == {"result": 0, "value": str(OPS_PER_BATCH), "mlx_loaded": False}


def test_without_an_nvidia_driver_the_question_is_no():
    """On this machine with no NVIDIA driver (CI, macOS) the driver query answers None, quickly."""
    from meshtune.runtime.gpu_batches import compute_capability_major

    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("an NVIDIA driver is present")
    assert compute_capability_major() is None
