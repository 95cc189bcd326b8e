"""A safetensors file written one tensor at a time, for weights that never sit in one rank's memory.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the tensors' bytes in that order. Every name,
shape and dtype is known before any value (a pipeline's ranks share them), so the header
is written first and each tensor's bytes follow as its value arrives; the writer holds
one tensor at a time. Atomic as checkpoint.atomic_save_safetensors: a temp file beside
the target, fsynced, then renamed over it.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from types import TracebackType

import mlx.core as mx
import numpy as np

from ..run_dir import temp_path

DTYPE_NAMES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.int64: "I64", mx.int32: "I32",
               mx.int16: "I16", mx.int8: "I8", mx.uint64: "U64", mx.uint32: "U32", mx.uint16: "U16",
               mx.uint8: "U8", mx.bool_: "BOOL"}


def header_bytes(entries: list[tuple[str, tuple[int, ...], mx.Dtype]]) -> bytes:
    """The length prefix and JSON header of a file holding `entries` (name, shape, dtype) in that order."""
    header: dict[str, object] = {"__metadata__": {"format": "mlx"}}
    start = 0
    for name, shape, dtype in entries:
        size = int(np.prod(shape, dtype=np.int64)) * dtype.size
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [start, start + size]}
        start += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


class StreamedSafetensors:
    """Write `entries` (name, shape, dtype) to `path`, each value through `write` in the same order."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...], mx.Dtype]]) -> None:
        self.path, self.entries, self.next = Path(path), list(entries), 0
        self.tmp = temp_path(self.path, str(os.getpid()), ".safetensors")
        self.file = open(self.tmp, "wb")
        self.file.write(header_bytes(self.entries))

    def write(self, name: str, value: mx.array) -> None:
        want, shape, dtype = self.entries[self.next]
        assert (name, tuple(value.shape), value.dtype) == (want, tuple(shape), dtype), (name, want)
        flat = mx.contiguous(value.reshape(-1)).view(mx.uint8)
        self.file.write(memoryview(np.asarray(flat)))
        self.next += 1

    def close(self, commit: bool = True) -> None:
        """Finish the file: with `commit`, fsynced and renamed into place (every tensor must have come);
        else the temp file is removed and the target left as it was."""
        try:
            if commit:
                if self.next != len(self.entries):
                    raise OSError(f"{self.path}: {len(self.entries) - self.next} tensors were never written")
                self.file.flush()
                os.fsync(self.file.fileno())
            self.file.close()
            if commit:
                os.replace(self.tmp, self.path)
        finally:
            self.file.close()
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> "StreamedSafetensors":
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.close(commit=kind is None)
