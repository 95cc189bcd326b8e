"""A gradient bucket's arrays packed into one flat array by one CUDA kernel (pack_kernel.cuh).

`mx.concatenate` on MLX's CUDA build copies each input with its own kernel: a LoRA bucket of a
16-layer model holds ~224 small arrays, so packing it dispatched ~224 copies a step on a step
already short of host time. Here one launch copies them all: a block row an array, a grid-stride
loop over its elements, each cast to the bucket's dtype.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import mlx.core as mx

from ..runtime.cuda import kernel, kernel_constant, read_source

# Arrays a launch: each is a pointer argument, and a kernel's arguments are limited (4 KiB).
MAX_ARRAYS = 256
SOURCE = Path(__file__).with_name("pack_kernel.cuh")


def _body(n: int) -> str:
    """The kernel's body: MLX names its inputs in0 .. in{n-1}, so a switch on blockIdx.y hands block row k its array."""
    cases = "\n".join(f"    case {k}: pack::copy_array(in{k}, offs, out); break;" for k in range(n))
    return f"switch (blockIdx.y) {{\n{cases}\n}}"


def pack_cuda(arrays: list[mx.array], dtype: mx.Dtype, max_arrays: int = MAX_ARRAYS) -> mx.array:
    """concatenate([a.reshape(-1).astype(dtype) for a in arrays]) with one kernel per `max_arrays` arrays."""
    arrays = [a for a in arrays if a.size]  # an empty array adds nothing (and has no buffer to pass)
    if len(arrays) <= 1:
        return arrays[0].reshape(-1).astype(dtype) if arrays else mx.zeros((0,), dtype=dtype)
    if len(arrays) > max_arrays:
        return mx.concatenate([pack_cuda(arrays[i:i + max_arrays], dtype, max_arrays)
                               for i in range(0, len(arrays), max_arrays)])
    n = len(arrays)
    offsets = [0]
    for a in arrays:
        offsets.append(offsets[-1] + a.size)
    names = [f"in{k}" for k in range(n)]
    # MLX caches a compiled kernel by its name and template values, not by its inputs' dtypes:
    # those go into the name, or a bucket of bfloat16 arrays would run float32's kernel.
    dtypes = ",".join(str(a.dtype) for a in arrays)
    k = kernel(f"meshtune_pack_{n}_{hashlib.sha1(dtypes.encode()).hexdigest()[:12]}", names + ["offs"], ["out"],
               _body(n), read_source(SOURCE))
    blocks = max(1, min(1024, -(-max(a.size for a in arrays) // 256)))
    (out,) = k(inputs=[*arrays, kernel_constant(offsets, mx.int64)], template=[("T", dtype)],
               grid=(blocks * 256, n, 1), threadgroup=(256, 1, 1),
               output_shapes=[(offsets[-1],)], output_dtypes=[dtype])
    return out
