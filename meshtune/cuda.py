"""What meshtune's CUDA kernels share: whether arrays run on an NVIDIA GPU, and a kernel cache.

The kernels themselves (adapters/kernels.py, parallel/pack_kernel.py) are written with
`mx.fast.cuda_kernel`, compiled by MLX's CUDA build at first use; elsewhere (CPU,
Metal) their callers compute the same in MLX ops.
"""

from __future__ import annotations

import mlx.core as mx

_kernels: dict[str, object] = {}


def on_cuda() -> bool:
    """Whether arrays are computed on an NVIDIA GPU (MLX's CUDA build, default device GPU)."""
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu


def kernel(name: str, inputs: list[str], outputs: list[str], source: str):
    """The `mx.fast.cuda_kernel` of this name, built once."""
    if name not in _kernels:
        _kernels[name] = mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs, source=source)
    return _kernels[name]
