"""Before a run writes anything: can it write to the output folder, and is there room?

`check_writable` runs before the model loads: it finds the output folder (or, when it
does not exist yet, the nearest folder above it that does) and writes an unnamed
temporary file there, so a path under a file, a read-only mount or a missing
permission is reported at once rather than at the first save, minutes in.
`check_free_space` needs the trainable parameters, so it runs right after the model
loads and before step 1: the disk must hold about two checkpoints (weights plus
optimizer state each) and the final adapters file. Neither creates the folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# Optimizer state per trainable parameter, in multiples of the parameter (adam keeps
# two moments; sgd and muon one momentum; adafactor keeps factored second moments,
# counted as one to stay on the safe side).
STATE_FACTOR = {"adam": 2, "adamw": 2, "sgd": 1, "muon": 1, "adafactor": 1}
MARGIN_BYTES = 1 << 20  # manifests, config.yaml, metrics: small, but not nothing


def nearest_existing(path: Path) -> Path:
    """`path` itself if it exists, else the closest ancestor that does."""
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(out: Path) -> None:
    """Raise a one-line ValueError unless files can be created in (or above) `out`."""
    link = Path(out).expanduser()
    if link.is_symlink() and not link.exists():  # mkdir would fail on it after the model loads
        raise ValueError(f"output.adapter_path={out} is a symbolic link to {os.readlink(link)}, which does not "
                         "exist; create that folder, remove the link, or choose another --adapter-path")
    here = nearest_existing(out)
    if not here.is_dir():
        raise ValueError(f"output.adapter_path={out}: {here} is a file, not a folder; "
                         "choose another --adapter-path")
    try:
        with tempfile.TemporaryFile(dir=here):  # unnamed on Linux: nothing is left behind
            pass
    except OSError as err:
        raise ValueError(f"output.adapter_path={out}: cannot create files in {here} "
                         f"({err.strerror or err}); make it writable or choose another --adapter-path") from None


def checkpoint_bytes(trainable_bytes: int, optimizer: str) -> int:
    """Estimated size of one checkpoint: the trainable weights and the optimizer state."""
    return trainable_bytes * (1 + STATE_FACTOR.get(optimizer, 2))


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def check_free_space(out: Path, *, trainable_bytes: int, optimizer: str) -> int:
    """Raise a one-line ValueError unless the disk of `out` holds ~2 checkpoints; returns the need."""
    need = 2 * checkpoint_bytes(trainable_bytes, optimizer) + trainable_bytes + MARGIN_BYTES
    here = nearest_existing(out)
    free = shutil.disk_usage(here).free
    if free < need:
        raise ValueError(f"output.adapter_path={out}: {human_bytes(free)} free on the disk of {here} but two "
                         f"checkpoints and the adapters need about {human_bytes(need)}; free space there or "
                         "choose another --adapter-path")
    return need
