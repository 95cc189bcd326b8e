"""BLAS selection: which library is described, and when a re-exec may happen."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from meshtune.runtime import blas


def test_describes_a_preloaded_openblas(monkeypatch):
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
    assert blas.describe_blas().startswith("BLAS: system OpenBLAS (")


def test_describes_the_reference_blas_with_a_hint(monkeypatch):
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setattr(blas, "find_system_openblas", lambda: None)
    assert blas.describe_blas() == ("BLAS: MLX's bundled reference BLAS; install libopenblas0-pthread "
                                    "for ~15x faster CPU matmuls")


@pytest.mark.parametrize("case", ["disabled", "env_off", "already", "not_linux", "mlx_loaded", "missing"])
def test_no_reexec_when_it_must_not(monkeypatch, case):
    calls = []
    monkeypatch.setattr(blas.os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(platform, "system", lambda: "Darwin" if case == "not_linux" else "Linux")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("MESHTUNE_BLAS_REEXEC", raising=False)
    monkeypatch.delenv("MESHTUNE_SYSTEM_BLAS", raising=False)  # else every case passes for that one reason
    monkeypatch.setattr(blas, "find_system_openblas", lambda: None if case == "missing" else "/x/libblas.so.3")
    if case == "env_off":
        monkeypatch.setenv("MESHTUNE_SYSTEM_BLAS", "0")
    if case == "already":
        monkeypatch.setenv("LD_PRELOAD", "/x/libblas.so.3")
    if case != "mlx_loaded":
        monkeypatch.delitem(blas.sys.modules, "mlx.core", raising=False)
    blas.ensure_fast_blas(enabled=case != "disabled", argv=["meshtune", "train"])
    assert calls == []


def test_reexec_preloads_and_marks(monkeypatch):
    calls = []
    monkeypatch.setattr(blas.os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("MESHTUNE_BLAS_REEXEC", raising=False)
    monkeypatch.delenv("MESHTUNE_SYSTEM_BLAS", raising=False)
    monkeypatch.setattr(blas, "find_system_openblas", lambda: "/x/libblas.so.3")
    monkeypatch.delitem(blas.sys.modules, "mlx.core", raising=False)
    blas.ensure_fast_blas(argv=["meshtune", "train", "--iters", "3"])
    (exe, argv, env), = calls
    assert argv[1:] == ["-m", "meshtune.cli", "train", "--iters", "3"]
    assert env["LD_PRELOAD"] == "/x/libblas.so.3" and env["MESHTUNE_BLAS_REEXEC"] == "1"


def test_a_system_blas_switch_other_than_1_or_0_is_a_one_line_error(tmp_path):
    environ = {k: v for k, v in os.environ.items() if k != "MESHTUNE_BLAS_REEXEC"} | {"MESHTUNE_SYSTEM_BLAS": "yes"}
    proc = subprocess.run([sys.executable, "-m", "meshtune.cli", "train", "--iters", "1",
                           "--adapter-path", str(tmp_path / "r")], capture_output=True, text=True, env=environ)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "MESHTUNE_SYSTEM_BLAS='yes'" in lines[0] and "1 (the default" in lines[0]
    assert not (tmp_path / "r").exists()
