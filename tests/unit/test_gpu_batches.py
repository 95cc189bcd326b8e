"""MLX's CUDA batch size (runtime/gpu_batches.py): set before MLX loads, only where MLX's default is 100,
never over the user's own value. Each case runs in a fresh interpreter, where MLX is not yet imported,
with the driver's answer stood in for (this machine may have no NVIDIA GPU)."""

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
def capability():
    seen["asked_with_mlx_loaded"] = "mlx.core" in sys.modules
    return CAPABILITY
gpu_batches.compute_capability = capability
if IMPORT_MLX:
    import mlx.core
result = RUN
child = gpu_batches.environment_without_ours(dict(os.environ)).get(gpu_batches.VARIABLE)
print(json.dumps({"result": result, "value": os.environ.get(gpu_batches.VARIABLE), "child": child, **seen}))
"""


def _run(capability: tuple[int, int] | None, *, user_value: str | None = None, import_mlx: bool = False,
         run: str = "gpu_batches.use_smaller_gpu_batches()") -> dict:
    # MESHTUNE_SYSTEM_BLAS=0: the command line's OpenBLAS re-exec would start a process without the stand-in.
    env = {k: v for k, v in os.environ.items() if k != VARIABLE} | {"MESHTUNE_SYSTEM_BLAS": "0"}
    if user_value is not None:
        env[VARIABLE] = user_value
    code = (CASE.replace("CAPABILITY", repr(capability)).replace("IMPORT_MLX", repr(import_mlx))
            .replace("RUN", run))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (12, 0)])
def test_a_gpu_where_mlx_batches_100_operations_gets_50(capability):
    """H100/H200, B200, consumer Blackwell; a peer tool's child gets MLX's own default back."""
    assert _run(capability) == {"result": True, "value": str(OPS_PER_BATCH), "child": None,
                                "asked_with_mlx_loaded": False}


@pytest.mark.parametrize("capability", [None, (7, 0), (8, 0), (8, 9), (10, 3), (12, 1)])
def test_no_gpu_or_one_where_mlx_batches_20_keeps_mlx_s_default(capability):
    """A100 and Ada (20 in MLX), DGX Spark (12.1: 20) and capabilities MLX does not list (20)."""
    out = _run(capability)
    assert out["result"] is False and out["value"] is None


def test_the_user_s_own_value_is_kept_and_passed_on():
    out = _run((9, 0), user_value="100")
    assert out["result"] is False and out["value"] == "100" and out["child"] == "100"


def test_nothing_is_set_once_mlx_is_loaded():
    """MLX reads the variable when it opens its GPU stream: set later, it would claim a batch size not in use."""
    out = _run((9, 0), import_mlx=True)
    assert out["result"] is False and out["value"] is None


def test_the_command_line_sets_it_before_mlx_loads():
    """`meshtune generate` goes through the command line's start as every computing subcommand does; its
    missing adapter folder is then a one-line error (exit 2)."""
    out = _run((9, 0), run='__import__("meshtune.cli", fromlist=["main"]).main('
                           '["generate", "--adapter-path", "/nonexistent/run", "--prompt", "x"])')
    assert out["result"] == 2 and out["value"] == str(OPS_PER_BATCH) and out["asked_with_mlx_loaded"] is False


def test_commands_that_compute_nothing_do_not_ask_the_driver():
    out = _run((9, 0), run='__import__("meshtune.cli", fromlist=["main"]).main(["config"])')
    assert out["result"] == 0 and out["value"] is None and "asked_with_mlx_loaded" not in out


def test_without_an_nvidia_driver_the_question_is_no():
    """On a machine with no NVIDIA driver (CI, macOS) the driver query answers None."""
    from meshtune.runtime.gpu_batches import compute_capability

    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("an NVIDIA driver is present")
    assert compute_capability() is None


def test_only_the_value_meshtune_set_is_kept_from_a_peer_tool():
    """The mark travels with meshtune's value (to a child meshtune too); the user's own 50 has none."""
    from meshtune.runtime.gpu_batches import SET_BY_MESHTUNE, environment_without_ours

    assert environment_without_ours({VARIABLE: "50", SET_BY_MESHTUNE: "1", "PATH": "/bin"}) == {"PATH": "/bin"}
    assert environment_without_ours({VARIABLE: "50", "PATH": "/bin"}) == {VARIABLE: "50", "PATH": "/bin"}
