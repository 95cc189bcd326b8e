"""meshtune: fine-tune language models with MLX on one machine or a cluster.

    from meshtune import Config, finetune
    result = finetune(Config())          # LoRA on the embedded tiny model

Names are imported lazily so that `meshtune.cli` can pick the BLAS before MLX loads.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Config": "meshtune.config",
    "load_config": "meshtune.config",
    "finetune": "meshtune.api",
    "fuse": "meshtune.api",
    "generate": "meshtune.api",
    "RunResult": "meshtune.api",
    "Mesh": "meshtune.runtime.mesh",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshtune' has no attribute {name!r}")
