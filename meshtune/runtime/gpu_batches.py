"""How many operations MLX's CUDA backend batches into one CUDA graph: set before MLX loads.

MLX's CUDA backend frees a buffer only once the GPU has finished the batch of kernels that read
it (up to MLX_MAX_OPS_PER_BUFFER operations a batch, up to 10 batches in flight), so a step's
temporaries in the batches still in flight are held together. MLX batches 100 operations on GPUs
of compute capability 9.0, 10.0 and 12.0 (H100, H200, B200, consumer Blackwell) and 20 on the
rest (`get_graph_limits`, mlx/backend/cuda/device.cpp). On an H100 the 1.7B full fine-tuning step
held 2.1 GB more at its peak with 100 than with 50, at the same speed (docs/performance.md, "Where
full fine-tuning's peak comes from"). `use_smaller_gpu_batches` sets 50 where MLX's default is
100, unless the variable is set already, judging by the first visible GPU. MLX reads it once, when
it opens its GPU stream at import, so this runs before anything imports MLX. Nothing here imports
MLX: the GPU is asked through the CUDA driver, which makes no context for it.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

VARIABLE = "MLX_MAX_OPS_PER_BUFFER"
OPS_PER_BATCH = 50
MLX_BATCHES_100 = ((9, 0), (10, 0), (12, 0))  # compute capabilities where MLX's default is 100

# cuDeviceGetAttribute's attributes (cuda.h).
_COMPUTE_CAPABILITY_MAJOR = 75
_COMPUTE_CAPABILITY_MINOR = 76

_set_here = False


def compute_capability() -> tuple[int, int] | None:
    """The first visible NVIDIA GPU's compute capability (major, minor), or None (no driver, no GPU)."""
    if platform.system() != "Linux":
        return None
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if driver.cuInit(0) != 0 or driver.cuDeviceGet(ctypes.byref(device), 0) != 0:
            return None
        for value, attribute in ((major, _COMPUTE_CAPABILITY_MAJOR), (minor, _COMPUTE_CAPABILITY_MINOR)):
            if driver.cuDeviceGetAttribute(ctypes.byref(value), attribute, device) != 0:
                return None
    except (OSError, AttributeError):
        return None
    return major.value, minor.value


def use_smaller_gpu_batches() -> bool:
    """Set MLX_MAX_OPS_PER_BUFFER to OPS_PER_BATCH where MLX's default is 100 and the user set none;
    True where it was set."""
    global _set_here
    if VARIABLE in os.environ or "mlx.core" in sys.modules:  # the user's choice; or too late
        return False
    if compute_capability() not in MLX_BATCHES_100:
        return False
    os.environ[VARIABLE] = str(OPS_PER_BATCH)
    _set_here = True
    return True


def environment_without_ours(environ: dict[str, str]) -> dict[str, str]:
    """`environ` less the variable where this process set it: what a peer tool's child process gets, so
    that stock mlx-lm runs with MLX's own default (a value the user set is passed on)."""
    return {k: v for k, v in environ.items() if not (_set_here and k == VARIABLE)}
