"""meshtune's CUDA kernel sources compile with NVIDIA's compiler, wrapped as MLX wraps them.

MLX's CUDA build compiles an `mx.fast.cuda_kernel` at its first call on the GPU, so a
kernel text NVRTC rejects would first show on a GPU machine, in the middle of a step.
Where `nvcc` is found (a CUDA toolkit without a GPU will do; skipped elsewhere), each
kernel the wrappers build (its .cuh header, then the kernel function around its body) is wrapped as MLX's CUDA
build wraps it (nvcc_sources.compiled_source) and compiled to PTX for the H200's sm_90. What the kernels
compute is the test_sim_*.py files'.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest

from nvcc_sources import RecordingKernel

NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None)
pytestmark = pytest.mark.skipif(NVCC is None, reason="no nvcc (CUDA toolkit) to compile the kernels with")


@pytest.fixture
def recorded(monkeypatch):
    from meshtune.adapters import kernels
    from meshtune.parallel import pack_kernel

    sources: dict[str, str] = {}

    def kernel(name, inputs, outputs, source, header=""):
        return RecordingKernel(sources, name, inputs, outputs, source, header)

    monkeypatch.setattr(kernels, "_kernel", kernel)
    monkeypatch.setattr(pack_kernel, "kernel", kernel)
    return sources


def _compile(path: Path) -> tuple[Path, subprocess.CompletedProcess]:
    return path, subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", "--ptx", "-w", str(path), "-o",
                                 str(path.with_suffix(".ptx"))], capture_output=True, text=True, timeout=300)


def test_every_kernel_compiles_for_sm90(recorded, tmp_path):
    from meshtune.adapters import kernels
    from meshtune.parallel.pack_kernel import pack_cuda

    k = iter(mx.random.split(mx.random.key(0), 64))
    for dtype in (mx.bfloat16, mx.float32):
        for r, inp in ((8, 2048), (16, 6144), (64, 1024)):  # the row norm's three layouts
            ws = [mx.random.normal((48, inp), key=next(k)).astype(dtype) for _ in range(2)]
            a = [mx.random.normal((inp, r), key=next(k)) for _ in range(2)]
            b = [mx.random.normal((r, 48), key=next(k)) for _ in range(2)]
            m = [mx.ones((48,))] * 2
            kernels.row_norms_cuda(ws, a, b, [2.0, 2.0])
            # The folded launch with A resident (where the layout takes it: rank 8, 2048 wide) and staged.
            for resident in (True, False):
                launch = kernels.RowNormLaunch(resident=resident)
                for merged in (False, True):
                    kernels.row_norms_and_scaled_cuda(ws, a, b, [2.0, 2.0], m, merged=merged, launch=launch)
                # A quantized base read packed, 4 bits (2 and 8 differ in template constants only: the simulator
                # runs them).
                packed = [kernels.PackedWeight(mx.zeros((48, inp // 8), dtype=mx.uint32),
                                               mx.ones((48, inp // 64), dtype=dtype),
                                               mx.zeros((48, inp // 64), dtype=dtype), 4, 64)] * 2
                if kernels.reads_packed(packed[0], r):
                    for merged in (False, True):
                        kernels.row_norms_and_scaled_cuda(packed, a, b, [2.0, 2.0], m, merged=merged, launch=launch)
        for cols in (6144, 6150):  # 16-byte accesses, then a column a thread
            g = mx.random.normal((64, cols), key=next(k)).astype(dtype)
            y = mx.random.normal((64, cols), key=next(k)).astype(dtype)
            kernels.cotangent_cuda(g, y, mx.ones((cols,)), mx.ones((cols,)))
            # m's and B's gradients, the norms read in a launch's stacked array; ranks 8 and 64 (fewer columns a thread)
            stacked = kernels.StackedNorm(mx.ones((2 * cols,)), cols, cols)
            for r in (8, 64):
                kernels.magnitude_and_b_grad_cuda(g, y, mx.ones((64, r), dtype=dtype), mx.ones((cols,)), stacked, 2.0)
    pack_cuda([mx.ones((3, 4), dtype=mx.bfloat16), mx.ones((5,))], mx.float32)
    assert len(recorded) >= 20, sorted(recorded)
    # Whole translation units of several kernels, one nvcc a core (the headers parsed once a unit, not once a
    # kernel: 79 s -> ~15 s on 2 cores); a unit that fails is compiled kernel by kernel to name the culprit.
    units = max(1, min(os.cpu_count() or 2, 4))
    funcs = sorted(recorded)
    members = {tmp_path / f"unit{u}.cu": funcs[u::units] for u in range(units)}
    for path, names in members.items():
        path.write_text("\n".join(recorded[f] for f in names))
    with ThreadPoolExecutor(max_workers=units) as pool:
        failed_units = [p for p, done in pool.map(_compile, members) if done.returncode != 0]
    failed = []
    for unit in failed_units:
        for func in members[unit]:
            path = tmp_path / f"{func}.cu"
            path.write_text(recorded[func])
            done = _compile(path)[1]
            if done.returncode != 0:
                failed.append((path.name, done.stderr[-2000:]))
    assert not failed_units or failed, f"{failed_units} failed together but compile one by one"
    assert not failed, failed[0]
