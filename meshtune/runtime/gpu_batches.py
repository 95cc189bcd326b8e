"""How many operations MLX's CUDA backend batches into one CUDA graph: set before MLX loads.

MLX's CUDA backend frees a buffer only once the GPU has finished the batch of kernels that read
it (up to MLX_MAX_OPS_PER_BUFFER operations a batch, up to 10 batches in flight), so a step's
temporaries in the batches still in flight are held together. On compute capability 9.0 and
above (H100, H200, B200) MLX batches 100 operations; there the 1.7B full fine-tuning step held
2.1 GB more at its peak than with 50, at the same speed (docs/performance.md, "Where full
fine-tuning's peak comes from"). `use_smaller_gpu_batches` sets 50 on such a GPU unless the
variable is set already. MLX reads it once, when it opens its GPU stream at import, so this runs
before anything imports MLX. Nothing here imports MLX: the GPU is asked through the CUDA driver.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

VARIABLE = "MLX_MAX_OPS_PER_BUFFER"
OPS_PER_BATCH = 50
FROM_COMPUTE_CAPABILITY = 9  # MLX's default is 100 operations a batch from here on (A100: 20)

# cuDeviceGetAttribute's attributes (cuda.h).
_COMPUTE_CAPABILITY_MAJOR = 75


def compute_capability_major() -> int | None:
    """The first visible NVIDIA GPU's compute capability major version, or None (no driver, no GPU)."""
    if platform.system() != "Linux":
        return None
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        device, major = ctypes.c_int(), ctypes.c_int()
        if driver.cuInit(0) != 0 or driver.cuDeviceGet(ctypes.byref(device), 0) != 0:
            return None
        if driver.cuDeviceGetAttribute(ctypes.byref(major), _COMPUTE_CAPABILITY_MAJOR, device) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return major.value


def use_smaller_gpu_batches(major: int | None = None) -> bool:
    """Set MLX_MAX_OPS_PER_BUFFER to OPS_PER_BATCH where MLX's default is larger and the user set none;
    True where it was set. `major` stands in for the GPU's compute capability (tests)."""
    if VARIABLE in os.environ or "mlx.core" in sys.modules:  # the user's choice; or too late
        return False
    major = compute_capability_major() if major is None else major
    if major is None or major < FROM_COMPUTE_CAPABILITY:
        return False
    os.environ[VARIABLE] = str(OPS_PER_BATCH)
    return True
