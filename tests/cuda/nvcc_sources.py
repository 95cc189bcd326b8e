"""Kernel sources as MLX's CUDA build compiles them, for nvcc where there is no GPU (test_kernels_nvcc.py)."""

from __future__ import annotations

import mlx.core as mx


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
                    input_dtypes: list, output_dtypes: list, template: list[tuple], header: str = "") -> tuple[str, str]:
    """(function name, whole source) of the kernel as MLX's CUDA build compiles it
    (mlx/backend/cuda/custom_kernel.cpp: its default header, then `header`, then the kernel function with the
    inputs as const pointers, the outputs as pointers, the template values as constexprs), with STAND_IN_HEADER
    for MLX's own: for nvcc where there is no GPU (tests/cuda/test_kernels_nvcc.py)."""
    func = "custom_kernel_" + name + "".join(
        f"_{CUDA_TYPES[v]}" if isinstance(v, mx.Dtype) else f"_{int(v)}" for _, v in template)
    params = [f"    const {CUDA_TYPES[d]}* {n}" for n, d in zip(input_names, input_dtypes)]
    params += [f"    {CUDA_TYPES[d]}* {n}" for n, d in zip(output_names, output_dtypes)]
    consts = [f"  using {n} = {CUDA_TYPES[v]};" if isinstance(v, mx.Dtype) else f"  constexpr int {n} = {int(v)};"
              for n, v in template]
    return func, (STAND_IN_HEADER + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
                  f"__global__ void {func}(\n" + ",\n".join(params) + ") {\n" + "\n".join(consts)
                  + "\n\n" + source + "\n}\n\n} // namespace mlx::core::cu\n")


class RecordingKernel:
    """Stands in for an mx.fast.cuda_kernel where there is no GPU: each call's compiled_source goes
    into `sources` (by function name) and zeros of the output shapes come back, enough for a
    wrapper to go on."""

    def __init__(self, sources: dict[str, str], name: str, input_names: list[str], output_names: list[str],
                 source: str, header: str = ""):
        self.sources, self.name, self.inputs, self.outputs = sources, name, input_names, output_names
        self.source, self.header = source, header

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **_):
        func, text = compiled_source(self.name, self.inputs, self.outputs, self.source, [a.dtype for a in inputs],
                                     output_dtypes, template, self.header)
        self.sources[func] = text
        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]
