"""Keep freed memory in the process on Linux, so each step's large arrays reuse warm pages.

MLX's CPU allocator takes every buffer from malloc and frees it after use, caching
nothing (`mx.get_cache_memory()` stays near 0 on the CPU). glibc serves blocks over its
mmap threshold (at most 32 MB: a dequantized weight, a logits array, a big activation)
with fresh mmap calls and unmaps them on free, so every training step touches its
large arrays' pages for the first time again: page faults on gigabytes a step, on
every step. `keep_freed_memory` has malloc serve them from the heap and not give freed
memory back below 2 GB, so a step reuses the pages of the step before. The process
keeps its peak resident size, as a training process does anyway. Quantized bases gain
most (their dequantized weights are such arrays): `meshtune bench adapters --preset 1b`
with and without `--no-keep-freed-memory` shows the difference.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_KEEP_BELOW = 2**31 - 1  # mallopt takes an int: freed memory above this is still returned

_applied = False


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep large freed blocks for reuse; True where it took effect.

    Does nothing off Linux or without glibc (musl, macOS: their allocators differ).
    Safe to call more than once. Allocations a thread's own arena cannot hold fall back
    to the main heap, which grows as needed.
    """
    global _applied
    if _applied:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _applied = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BELOW))
    except (OSError, AttributeError):
        return False
    return _applied
