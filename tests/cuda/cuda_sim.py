"""The CPU simulator's stand-in for `mx.fast.cuda_kernel`, shared by the tests/cuda/test_sim_*.py files.

CI has no GPU, so the kernel sources (meshtune/adapters/cuda/*.cuh, meshtune/parallel/pack_kernel.cuh) would
otherwise be checked only when someone runs the suite on a GPU. `SimulatedKernel` compiles the same header and
kernel body with g++ into a program where every CUDA thread is a fiber on one OS thread (blocks one after
another, barriers for __syncthreads, an exchange buffer for warp shuffles; sim/harness.hpp), with the launch
geometry and template constants the Python wrappers chose. float stands in for every floating element type.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np

HARNESS = Path(__file__).parent / "sim"
CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")
CXX_FLAGS = ["-std=c++20", "-O1", "-w"]
# The folded backward's two launches for m's and B's gradients: B's product summed in the column sums' pass,
# then the chunks added.
FOLDED_SUMS, FOLDED_GRAD = "meshtune_dora_column_and_b_sums", "meshtune_dora_magnitude_b_sums_grad"


def harness_runs(tmp: Path) -> bool:
    """Whether the harness builds and runs here: a block of 64 threads through a barrier and a shuffle."""
    if CXX is None:
        return False
    src = tmp / "check.cpp"
    src.write_text('#include "harness.hpp"\nfloat out[64];\nint main() {\n'
                   '  sim_launch(128, 1, 64, [] { float v = threadIdx.x; __syncthreads();\n'
                   '    out[threadIdx.x] = __shfl_xor_sync(0xffffffff, v, 1); });\n'
                   '  return out[0] == 1.0f && out[33] == 32.0f ? 0 : 1;\n}\n')
    built = subprocess.run([CXX, *CXX_FLAGS, f"-I{HARNESS}", str(src), "-o", str(tmp / "check")], capture_output=True)
    return built.returncode == 0 and subprocess.run([str(tmp / "check")], capture_output=True).returncode == 0


class SimulatedKernel:
    """Stands in for an mx.fast.cuda_kernel: same call, run by the CPU simulator. As MLX's CUDA build does, the
    program holds the header, then the kernel function with the template values as constants, then the body."""

    def __init__(self, build_dir: Path, name: str, input_names: list, output_names: list, source: str,
                 header: str = ""):
        self.dir, self.name, self.inputs, self.outputs = build_dir, name, input_names, output_names
        self.source, self.header = source, header
        self.calls = 0
        self.seen = {}
        self.smallest_input = 1 << 62  # bytes of the smallest array any call handed it

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **_):
        assert threadgroup[1:] == (1, 1) and grid[2] == 1, "the simulator takes x blocks and a y grid"
        # MLX caches a compiled kernel by name and template values only: two calls that share
        # them must share their inputs' dtypes, or the second runs the first one's kernel.
        key = (self.name, tuple((n, str(v)) for n, v in template))
        dtypes = tuple(a.dtype for a in inputs)
        assert self.seen.setdefault(key, dtypes) == dtypes, f"{self.name}: one cached kernel for inputs {dtypes}"
        self.smallest_input = min(self.smallest_input, *(a.nbytes for a in inputs))
        consts = []
        for name, value in template:
            if isinstance(value, mx.Dtype):
                consts.append(f"  typedef float {name};")
            else:
                consts.append(f"  constexpr int {name} = {int(value)};")
        ctypes = [{mx.int64: "long long", mx.int32: "int", mx.uint32: "unsigned"}.get(a.dtype, "float") for a in inputs]
        params = [f"const {c}* {n}" for c, n in zip(ctypes, self.inputs)] + [f"float* {n}" for n in self.outputs]
        sizes = [int(np.prod(s)) for s in output_shapes]
        reads = "\n".join(f"  auto i{k} = sim_read<{c}>(argv[{k + 1}], {a.size});"
                          for k, (c, a) in enumerate(zip(ctypes, inputs)))
        allocs = "\n".join(f"  std::vector<float> o{k}({n});" for k, n in enumerate(sizes))
        args = ", ".join([f"i{k}.data()" for k in range(len(inputs))] + [f"o{k}.data()" for k in range(len(sizes))])
        writes = "\n".join(f"  sim_write(argv[{len(inputs) + k + 1}], o{k});" for k in range(len(sizes)))
        program = (f'#include "harness.hpp"\n{self.header}\n'
                   f"void body({', '.join(params)}) {{\n{chr(10).join(consts)}\n{self.source}\n}}\n"
                   f"int main(int argc, char** argv) {{\n{reads}\n{allocs}\n"
                   f"  sim_launch({grid[0]}, {grid[1]}, {threadgroup[0]}, [&] {{ body({args}); }});\n{writes}\n}}\n")
        tag = hashlib.sha1(program.encode()).hexdigest()[:16]
        exe = self.dir / f"{self.name}_{tag}"
        if not exe.exists():
            src = exe.with_suffix(".cpp")
            src.write_text(program)
            done = subprocess.run([CXX, *CXX_FLAGS, f"-I{self.dir}", f"-I{HARNESS}", str(src), "-o", str(exe)],
                                  capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-3000:]
        files_in = []
        for k, (c, a) in enumerate(zip(ctypes, inputs)):
            path = self.dir / f"{tag}_in{k}.bin"
            np.array(a.astype({"long long": mx.int64, "int": mx.int32, "unsigned": mx.uint32}.get(c, mx.float32))).tofile(path)
            files_in.append(str(path))
        files_out = [str(self.dir / f"{tag}_out{k}.bin") for k in range(len(sizes))]
        ran = subprocess.run([str(exe), *files_in, *files_out], capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0, ran.stderr[-3000:]
        self.calls += 1
        return [mx.array(np.fromfile(f, dtype=np.float32).reshape(s)).astype(d)
                for f, s, d in zip(files_out, output_shapes, output_dtypes)]


def calls(simulated: dict, kernel: str) -> int:
    """How often the simulated `kernel` ran (0 if never)."""
    return simulated[kernel].calls if kernel in simulated else 0


def assert_same_bits(got: tuple, want: tuple, label) -> None:
    """Each list of arrays in `got` equals `want`'s, array by array, to the bit."""
    assert len(got) == len(want), label
    for got_part, want_part in zip(got, want):
        for x, y in zip(got_part, want_part):
            assert mx.array_equal(x, y).item(), label
