"""What meshtune's CUDA kernels share: whether arrays run on an NVIDIA GPU, and a kernel cache.

The kernels themselves (adapters/kernels.py, parallel/pack_kernel.py) are written with
`mx.fast.cuda_kernel`, compiled by MLX's CUDA build at first use; elsewhere (CPU,
Metal) their callers compute the same in MLX ops.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx

_kernels: dict[tuple, object] = {}


def on_cuda() -> bool:
    """Whether arrays are computed on an NVIDIA GPU (MLX's CUDA build, default device GPU)."""
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu


def kernel(name: str, inputs: list[str], outputs: list[str], source: str):
    """The `mx.fast.cuda_kernel` of this name, built once.

    MLX's CUDA build keeps compiled kernels on disk (MLX_PTX_CACHE_DIR, by default under the temp
    directory) by name and template values alone, not by source: a kernel whose text changed (a newer
    meshtune) would run the old text's binary, with the old parameters. So the name MLX sees carries a
    digest of the parameters and the source.
    """
    key = (name, tuple(inputs), tuple(outputs), source)
    if key not in _kernels:
        digest = hashlib.sha1("\0".join([*inputs, "", *outputs, "", source]).encode()).hexdigest()[:12]
        _kernels[key] = mx.fast.cuda_kernel(name=f"{name}_{digest}", input_names=inputs, output_names=outputs,
                                            source=source)
    return _kernels[key]


# MLX's CUDA allocator puts every array of 8 bytes or less in one small pool of managed memory, which the
# host writes each new Python scalar into and the GPU reads across the bus (advised accessed-by, never
# migrated). A one-int offset and a one-float scale read from there held m's gradient launch at 11-25 us a
# layer on an H200, growing with its blocks (ncu, docs/bench/adapters_h200_23.txt): the constants our
# kernels read are padded out of that pool.
# One array a value: made once, its page moves to the GPU at its first read and stays (an uncompiled step
# would otherwise write a new one each call, and the GPU fault it in each time).
KERNEL_CONSTANT_BYTES = 16
_constants: dict[tuple, mx.array] = {}


def kernel_constant(values: list, dtype: mx.Dtype) -> mx.array:
    """`values` as an array a kernel reads (entries 0 .. len - 1), zero-padded to KERNEL_CONSTANT_BYTES at least.

    Data, not an operation: a compiled step holds it as a constant."""
    pad = max(0, -(-KERNEL_CONSTANT_BYTES // dtype.size) - len(values))
    key = (tuple(values), str(dtype), pad)
    if key not in _constants:
        _constants[key] = mx.array(list(values) + [0] * pad, dtype=dtype)
    return _constants[key]


# The CUDA type MLX's CUDA build gives each dtype in a kernel's parameters.
CUDA_TYPES = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float", mx.int32: "int32_t",
              mx.uint32: "uint32_t", mx.int64: "int64_t", mx.uint8: "uint8_t", mx.bool_: "bool"}
# In place of MLX's device header (not in its wheels): what meshtune's kernels use.
STAND_IN_HEADER = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <cooperative_groups.h>
#include <cuda/std/limits>
#define inf cuda::std::numeric_limits<float>::infinity()
"""


def compiled_source(name: str, input_names: list[str], output_names: list[str], source: str,
                    input_dtypes: list, output_dtypes: list, template: list[tuple]) -> tuple[str, str]:
    """(function name, whole source) of the kernel as MLX's CUDA build compiles it
    (mlx/backend/cuda/custom_kernel.cpp: the inputs as const pointers, the outputs as pointers,
    the template values as constexprs), with STAND_IN_HEADER: for nvcc where there is no GPU
    (tests/test_kernels_nvcc.py, scripts/probes/kernel_registers.py)."""
    func = "custom_kernel_" + name + "".join(
        f"_{CUDA_TYPES[v]}" if isinstance(v, mx.Dtype) else f"_{int(v)}" for _, v in template)
    params = [f"    const {CUDA_TYPES[d]}* {n}" for n, d in zip(input_names, input_dtypes)]
    params += [f"    {CUDA_TYPES[d]}* {n}" for n, d in zip(output_names, output_dtypes)]
    consts = [f"  using {n} = {CUDA_TYPES[v]};" if isinstance(v, mx.Dtype) else f"  constexpr int {n} = {int(v)};"
              for n, v in template]
    return func, (STAND_IN_HEADER + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
                  f"__global__ void {func}(\n" + ",\n".join(params) + ") {\n" + "\n".join(consts)
                  + "\n\n" + source + "\n}\n\n} // namespace mlx::core::cu\n")


class RecordingKernel:
    """Stands in for an mx.fast.cuda_kernel where there is no GPU: each call's compiled_source goes
    into `sources` (by function name) and zeros of the output shapes come back, enough for a
    wrapper to go on."""

    def __init__(self, sources: dict[str, str], name: str, input_names: list[str], output_names: list[str],
                 source: str):
        self.sources, self.name, self.inputs, self.outputs, self.source = sources, name, input_names, output_names, source

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **_):
        func, text = compiled_source(self.name, self.inputs, self.outputs, self.source, [a.dtype for a in inputs],
                                     output_dtypes, template)
        self.sources[func] = text
        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]
