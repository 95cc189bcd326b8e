"""Fixtures for the CUDA tests: `simulated` runs every meshtune kernel through the CPU simulator (cuda_sim.py)."""

import subprocess

import pytest

from cuda_sim import CXX, CXX_FLAGS, HARNESS, SimulatedKernel, harness_runs


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cuda_sim")
    if not harness_runs(tmp):
        pytest.skip("no C++20 compiler with ucontext (g++ 10+ or clang++ 12+) to simulate the CUDA kernels")
    # The harness precompiled once, with the programs' own flags: a program then builds in ~0.7 s, not ~1.6 s
    # (the standard headers are most of it). Where the compiler makes none, the programs read the header itself.
    subprocess.run([CXX, *CXX_FLAGS, "-x", "c++-header", str(HARNESS / "harness.hpp"), "-o",
                    str(tmp / "harness.hpp.gch")], capture_output=True)
    return tmp


@pytest.fixture
def simulated(build_dir, monkeypatch):
    """CUDA as far as meshtune can tell, with every kernel simulated; returns the kernels made, by name."""
    from meshtune.adapters import kernels
    from meshtune.parallel import gradient_sums, pack_kernel

    made = {}

    def kernel(name, inputs, outputs, source, header=""):
        made.setdefault(name, SimulatedKernel(build_dir, name, inputs, outputs, source, header))
        return made[name]

    monkeypatch.setattr(kernels, "_kernel", kernel)
    monkeypatch.setattr(pack_kernel, "kernel", kernel)
    monkeypatch.setattr(kernels, "on_cuda", lambda: True)
    monkeypatch.setattr(gradient_sums, "on_cuda", lambda: True)
    return made
