"""Keep freed memory in the process on Linux, so each step's large arrays reuse warm pages.

MLX's CPU allocator takes every buffer from malloc and frees it after use. glibc serves blocks
over its mmap threshold (a dequantized weight, a logits array, a big activation) with fresh mmap
calls and unmaps them on free, so every step would fault in its large arrays' pages again.
`keep_freed_memory` has malloc serve them from the heap and keep freed memory below 2 GB, so a
step reuses the pages of the step before (docs/performance.md, "Freed memory kept in the process"; `meshtune
bench adapters --preset 1b` with and without `--no-keep-freed-memory` shows it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_KEEP_BELOW = 2**31 - 1  # mallopt takes an int: freed memory above this is still returned

def keep_freed_memory() -> bool:
    """Have glibc's malloc keep large freed blocks for reuse; True where it took effect.

    Does nothing off Linux or without glibc (musl, macOS: their allocators differ). A setting of
    the process's malloc, not of a run: calling it again sets the same values again. Allocations a
    thread's own arena cannot hold fall back to the main heap, which grows as needed.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BELOW))
    except (OSError, AttributeError):
        return False
