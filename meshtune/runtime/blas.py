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
from typing import Mapping

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


def preloaded_blas(environ: Mapping[str, str] = os.environ) -> str | None:
    """The OpenBLAS already preloaded into `environ` (this process's by default), if any."""
    for entry in environ.get("LD_PRELOAD", "").replace(":", " ").split():
        if "blas" in Path(entry).name.lower():
            return entry
    return None


def describe_blas() -> str:
    """One line saying which BLAS MLX uses in this process."""
    return blas_line(platform.system(), os.environ, find_system_openblas())


def blas_line(system: str, environ: Mapping[str, str], openblas: str | None) -> str:
    """describe_blas's line for a platform `system`, an environment and the system OpenBLAS found (or None)."""
    if system != "Linux":
        return "BLAS: platform default (Accelerate on macOS)"
    if (lib := preloaded_blas(environ)) is not None:
        return f"BLAS: system OpenBLAS ({lib})"
    hint = "" if openblas else "; install libopenblas0-pthread for ~15x faster CPU matmuls"
    return f"BLAS: MLX's bundled reference BLAS{hint}"


def ensure_fast_blas(enabled: bool = True, argv: list[str] | None = None) -> None:
    """Re-exec this process with a system OpenBLAS preloaded, when one exists (see reexec_command)."""
    found = reexec_command(sys.argv if argv is None else argv, os.environ, enabled=enabled, system=platform.system(),
                           mlx_loaded="mlx.core" in sys.modules, openblas=find_system_openblas(),
                           executable=sys.executable)
    if found is None:
        return
    command, env = found
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, env)


def reexec_command(argv: list[str], environ: Mapping[str, str], *, enabled: bool, system: str, mlx_loaded: bool,
                   openblas: str | None, executable: str) -> tuple[list[str], dict[str, str]] | None:
    """The command line `argv` run again with `openblas` preloaded, and its environment; None where not.

    None off Linux, when disabled (option or MESHTUNE_SYSTEM_BLAS=0), when a BLAS is already
    preloaded, when MLX is already imported (too late to swap), with no OpenBLAS, or after one
    re-exec (never loops). A MESHTUNE_SYSTEM_BLAS other than 1 or 0 is a one-line ValueError.
    """
    allowed = choice(DISABLE_ENV, environ.get(DISABLE_ENV, "1"), {"1": True, "0": False},
                     "1 (the default: preload the system's OpenBLAS on Linux) or 0 (keep MLX's bundled BLAS)")
    if not enabled or not allowed:
        return None
    if system != "Linux" or environ.get(_REEXEC_MARK) or preloaded_blas(environ):
        return None
    if mlx_loaded or openblas is None:
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = " ".join(x for x in (openblas, env.get("LD_PRELOAD", "")) if x)
    env[_REEXEC_MARK] = "1"
    return [executable, "-m", "meshtune.cli", *argv[1:]], env
