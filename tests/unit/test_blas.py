"""BLAS selection: which library is described, and when a re-exec may happen."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from meshtune.runtime import blas


OPENBLAS = "/x/libblas.so.3"


def test_describes_a_preloaded_openblas():
    preloaded = {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"}
    assert blas.blas_line("Linux", preloaded, OPENBLAS).startswith("BLAS: system OpenBLAS (")


def test_describes_the_reference_blas_with_a_hint():
    assert blas.blas_line("Linux", {}, None) == ("BLAS: MLX's bundled reference BLAS; install libopenblas0-pthread "
                                                 "for ~15x faster CPU matmuls")
    assert blas.blas_line("Linux", {}, OPENBLAS) == "BLAS: MLX's bundled reference BLAS"
    assert blas.blas_line("Darwin", {}, None) == "BLAS: platform default (Accelerate on macOS)"


def _reexec(case: str = "") -> tuple[list[str], dict[str, str]] | None:
    """reexec_command on a Linux machine with an OpenBLAS and MLX not loaded, less what `case` takes away."""
    environ = {"PATH": "/bin"} | ({"MESHTUNE_SYSTEM_BLAS": "0"} if case == "env_off" else {}) | (
        {"LD_PRELOAD": OPENBLAS} if case == "already" else {}) | (
        {"MESHTUNE_BLAS_REEXEC": "1"} if case == "done_once" else {})
    return blas.reexec_command(["meshtune", "train", "--iters", "3"], environ, enabled=case != "disabled",
                               system="Darwin" if case == "not_linux" else "Linux",
                               mlx_loaded=case == "mlx_loaded", openblas=None if case == "missing" else OPENBLAS,
                               executable="/py")


@pytest.mark.parametrize("case", ["disabled", "env_off", "already", "done_once", "not_linux", "mlx_loaded",
                                  "missing"])
def test_no_reexec_when_it_must_not(case):
    assert _reexec(case) is None


def test_reexec_preloads_and_marks():
    command, env = _reexec()
    assert command == ["/py", "-m", "meshtune.cli", "train", "--iters", "3"]
    assert env == {"PATH": "/bin", "LD_PRELOAD": OPENBLAS, "MESHTUNE_BLAS_REEXEC": "1"}


def test_a_system_blas_switch_other_than_1_or_0_is_a_one_line_error(tmp_path):
    environ = {k: v for k, v in os.environ.items() if k != "MESHTUNE_BLAS_REEXEC"} | {"MESHTUNE_SYSTEM_BLAS": "yes"}
    proc = subprocess.run([sys.executable, "-m", "meshtune.cli", "train", "--iters", "1",
                           "--adapter-path", str(tmp_path / "r")], capture_output=True, text=True, env=environ)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "MESHTUNE_SYSTEM_BLAS='yes'" in lines[0] and "1 (the default" in lines[0]
    assert not (tmp_path / "r").exists()
