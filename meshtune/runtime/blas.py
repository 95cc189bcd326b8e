"""Pick a fast BLAS for MLX on Linux CPUs before MLX loads.

MLX's Linux CPU wheel links the reference BLAS (a 1024^2 float32 matmul runs at
about 4 GFLOP/s); Debian's OpenBLAS, preloaded, gives the same results roughly 15x
faster. The only way to swap the library under an already-built extension is to
preload it, so `ensure_fast_blas` re-executes the current command once with
LD_PRELOAD set. It must run before anything imports `mlx`. Nothing here imports MLX.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from .env import choice

# Debian/Ubuntu package libopenblas0-pthread installs the BLAS here (x86_64, aarch64).
SYSTEM_OPENBLAS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)
_REEXEC_MARK = "MESHTUNE_BLAS_REEXEC"
DISABLE_ENV = "MESHTUNE_SYSTEM_BLAS"


def find_system_openblas() -> str | None:
    """Path of a system OpenBLAS that can stand in for MLX's BLAS, or None."""
    for path in SYSTEM_OPENBLAS:
        if Path(path).exists():
            return path
    return None


def preloaded_blas() -> str | None:
    """The OpenBLAS already preloaded into this process's environment, if any."""
    for entry in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        if "blas" in Path(entry).name.lower():
            return entry
    return None


def describe_blas() -> str:
    """One line saying which BLAS MLX uses in this process."""
    if platform.system() != "Linux":
        return "BLAS: platform default (Accelerate on macOS)"
    if (lib := preloaded_blas()) is not None:
        return f"BLAS: system OpenBLAS ({lib})"
    hint = "" if find_system_openblas() else "; install libopenblas0-pthread for ~15x faster CPU matmuls"
    return f"BLAS: MLX's bundled reference BLAS{hint}"


def ensure_fast_blas(enabled: bool = True, argv: list[str] | None = None) -> None:
    """Re-exec this process with a system OpenBLAS preloaded, when one exists.

    Does nothing off Linux, when disabled (option or MESHTUNE_SYSTEM_BLAS=0), when a
    BLAS is already preloaded, when MLX is already imported (too late to swap), or
    after one re-exec (never loops).
    """
    allowed = choice(DISABLE_ENV, os.environ.get(DISABLE_ENV, "1"), {"1": True, "0": False},
                     "1 (the default: preload the system's OpenBLAS on Linux) or 0 (keep MLX's bundled BLAS)")
    if not enabled or not allowed:
        return
    if platform.system() != "Linux" or os.environ.get(_REEXEC_MARK) or preloaded_blas():
        return
    if "mlx.core" in sys.modules:
        return
    lib = find_system_openblas()
    if lib is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(x for x in (lib, env.get("LD_PRELOAD", "")) if x)
    env[_REEXEC_MARK] = "1"
    args = sys.argv if argv is None else argv
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "meshtune.cli", *args[1:]], env)
