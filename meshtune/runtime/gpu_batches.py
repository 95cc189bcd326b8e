"""How many operations MLX's CUDA backend batches into one CUDA graph: set before MLX loads.

MLX's CUDA backend frees a buffer only once the GPU has finished the batch of kernels that read it
(up to MLX_MAX_OPS_PER_BUFFER operations a batch), so a step's temporaries in flight are held
together. MLX batches 100 on GPUs of compute capability 9.0, 10.0 and 12.0 and 20 elsewhere; at 50
an H100's 1.7B full fine-tuning peak is 2.1 GB lower at the same speed (docs/performance.md, "Where
full fine-tuning's peak comes from"). `use_smaller_gpu_batches` sets 50 where MLX's default is 100
and the user set nothing, judging by the first visible GPU, before anything imports MLX (MLX reads
it once, at import). Nothing here imports MLX: the GPU is asked through the CUDA driver.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from typing import Mapping, MutableMapping

VARIABLE = "MLX_MAX_OPS_PER_BUFFER"
# Set beside VARIABLE where meshtune, not the user, chose its value: the fact travels with the value,
# to this process's children too.
SET_BY_MESHTUNE = "MESHTUNE_SET_MLX_MAX_OPS_PER_BUFFER"
OPS_PER_BATCH = 50
MLX_BATCHES_100 = ((9, 0), (10, 0), (12, 0))  # compute capabilities where MLX's default is 100

# cuDeviceGetAttribute's attributes (cuda.h).
_COMPUTE_CAPABILITY_MAJOR = 75
_COMPUTE_CAPABILITY_MINOR = 76


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


def use_smaller_gpu_batches(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set MLX_MAX_OPS_PER_BUFFER to OPS_PER_BATCH in `environ` (this process's, which MLX reads) where
    MLX's default is 100 and the user set none; True where it was set."""
    if VARIABLE in environ or "mlx.core" in sys.modules:  # the user's choice; or too late
        return False
    if compute_capability() not in MLX_BATCHES_100:
        return False
    environ[VARIABLE] = str(OPS_PER_BATCH)
    environ[SET_BY_MESHTUNE] = "1"
    return True


def environment_without_ours(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` less the variable where meshtune set it: what a peer tool's child process gets, so that
    stock mlx-lm runs with MLX's own default (a value the user set is passed on)."""
    ours = environ.get(SET_BY_MESHTUNE) == "1"
    return {k: v for k, v in environ.items() if not (ours and k in (VARIABLE, SET_BY_MESHTUNE))}
