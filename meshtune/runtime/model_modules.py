"""Pointing a function that mlx-lm's model modules call at meshtune's own, and back.

mlx-lm's model files import their helpers by name (`from .activations import swiglu`,
`from .base import scaled_dot_product_attention`), so the one place to swap a helper for every
loaded model is each module's name for it (runtime/fastmath.py's SwiGLU on the CPU,
training/attention.py's chunked attention).
"""

from __future__ import annotations

import sys
from typing import Any, Callable


def replace_in_models(name: str, new: Any, where: Callable[[Any], bool]) -> int:
    """Point `name` at `new` in every loaded mlx-lm model module whose `name` passes `where`, never in
    the module that defines it; returns how many were pointed."""
    count = 0
    for module_name, module in list(sys.modules.items()):
        value = getattr(module, name, None)
        if (module_name.startswith("mlx_lm.models.") and value is not None and where(value)
                and getattr(value, "__module__", None) != module_name):
            setattr(module, name, new)
            count += 1
    return count
