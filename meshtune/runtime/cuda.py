"""What meshtune's CUDA kernels share: whether arrays run on an NVIDIA GPU, and a kernel cache.

The kernels themselves are .cuh files beside their loaders (adapters/cuda/ for adapters/kernels.py,
parallel/pack_kernel.cuh for parallel/pack_kernel.py): each launch is an `mx.fast.cuda_kernel` whose
header is the file and whose body is a short call, compiled by MLX's CUDA build at first use;
elsewhere (CPU, Metal) their callers compute the same in MLX ops. The three `functools.cache`s below
are memos, not run state: each entry is a function of its key alone (a kernel of its whole text, a
file of its path, a constant of its values), so no run's choice reaches them; they spare MLX a
recompile, the disk a read and the GPU a page move.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

def on_cuda() -> bool:
    """Whether arrays are computed on an NVIDIA GPU (MLX's CUDA build, default device GPU)."""
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu


# MLX's CUDA backend differentiates its fused (cuDNN) attention only where the query length is a
# multiple of 128 (ScaledDotProductAttentionVJP::use_fallback, mlx/backend/cuda); any other length
# takes the unfused backward, which keeps every layer's whole attention matrix. Training batches
# are padded to it there (data/batches.py); mlx_lm.lora's 1024-token rows give 1023 model inputs.
FUSED_ATTENTION_MULTIPLE = 128
# What cuDNN's attention takes (supports_sdpa_cudnn): half-precision inputs, a head dim that is a
# multiple of 8 and at most 128. Other models attend unfused at any length, so padding buys nothing.
CUDNN_ATTENTION_DTYPES = (mx.bfloat16, mx.float16)
CUDNN_MAX_HEAD_DIM = 128


def attention_inputs_multiple(model: nn.Module, nvidia: bool | None = None) -> int | None:
    """What `model`'s inputs' length must be a multiple of for its fused attention backward on an NVIDIA
    GPU (`nvidia`; None: whether arrays run on one here): FUSED_ATTENTION_MULTIPLE where cuDNN takes its
    attention, else None."""
    if not (on_cuda() if nvidia is None else nvidia):
        return None
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", 0) or 0
    head_dim = getattr(args, "head_dim", None) or (getattr(args, "hidden_size", 0) // heads if heads else 0)
    if head_dim and (head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM):
        return None
    if activation_dtype(model) not in CUDNN_ATTENTION_DTYPES:
        return None
    return FUSED_ATTENTION_MULTIPLE


def activation_dtype(model: nn.Module) -> mx.Dtype | None:
    """The floating dtype most of `model`'s parameter elements have: its activations' (a quantized model's
    scales'). Counted by elements, not arrays: float32 adapters on every block are more arrays than the
    bfloat16 base weights they adapt, and far fewer elements."""
    sizes: dict[mx.Dtype, int] = {}
    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            sizes[v.dtype] = sizes.get(v.dtype, 0) + v.size
    return max(sizes, key=sizes.get) if sizes else None


def kernel(name: str, inputs: list[str], outputs: list[str], source: str, header: str = ""):
    """The `mx.fast.cuda_kernel` of this name, built once: `header` (device functions, from a .cuh file) goes
    before the kernel function MLX writes around `source` (its body).

    MLX's CUDA build keeps compiled kernels on disk (MLX_PTX_CACHE_DIR, by default under the temp
    directory) by name and template values alone, not by source: a kernel whose text changed (a newer
    meshtune) would run the old text's binary, with the old parameters. So the name MLX sees carries a
    digest of the parameters, the source and the header.
    """
    return _built(name, tuple(inputs), tuple(outputs), source, header)


@functools.cache  # a function of its arguments: the same text is one kernel
def _built(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], source: str, header: str):
    digest = hashlib.sha1("\0".join([*inputs, "", *outputs, "", source, "", header]).encode()).hexdigest()[:12]
    return mx.fast.cuda_kernel(name=f"{name}_{digest}", input_names=list(inputs), output_names=list(outputs),
                               source=source, header=header)


@functools.cache
def read_source(path: Path) -> str:
    """A kernel source file's text (a .cuh beside its loader), read once."""
    return path.read_text()


# MLX's CUDA allocator puts every array of 8 bytes or less in one small pool of managed memory, which the
# GPU reads across the bus: the constants our kernels read are padded out of that pool, one array a value,
# made once, so its page moves to the GPU at its first read and stays.
KERNEL_CONSTANT_BYTES = 16


def kernel_constant(values: list, dtype: mx.Dtype) -> mx.array:
    """`values` as an array a kernel reads (entries 0 .. len - 1), zero-padded to KERNEL_CONSTANT_BYTES at least.

    Data, not an operation: a compiled step holds it as a constant."""
    return _constant(tuple(values), dtype)


@functools.cache  # one array a value: its page stays on the GPU after the first read
def _constant(values: tuple, dtype: mx.Dtype) -> mx.array:
    pad = max(0, -(-KERNEL_CONSTANT_BYTES // dtype.size) - len(values))
    return mx.array(list(values) + [0] * pad, dtype=dtype)
