"""Frozen quantized layers that carry no adapter take the measured base path too.

A 4-bit model keeps quantized layers that no adapter wraps: the LM head, a tied
quantized embedding used as the head, blocks outside `num_layers`, MoE experts not
targeted. At training token counts their `quantized_matmul` dominates the step (on
this CPU a 4-bit head took ~890 ms of an 1150 ms step; dense took ~40 ms). Swapping
them for subclasses whose forward goes through the model's BasePath keeps every parameter name
and value (stock mlx-lm save, fuse and load see the same layers) and changes only
which kernel multiplies.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from .base_path import BasePath


class RoutedQuantizedLinear(nn.QuantizedLinear):
    """A frozen QuantizedLinear whose product picks the kernel by token count (its `base_path`)."""

    base_path: BasePath

    def __call__(self, x: mx.array) -> mx.array:
        return self.base_path.linear_forward(self, x)


class RoutedQuantizedEmbedding(nn.QuantizedEmbedding):
    """A frozen QuantizedEmbedding whose tied-head product picks the kernel by token count."""

    base_path: BasePath

    def as_linear(self, x: mx.array) -> mx.array:
        return self.base_path.linear_forward(self, x, bias=False)


class RoutedQuantizedSwitchLinear(QuantizedSwitchLinear):
    """Frozen quantized experts on the gather kernel the token count favours."""

    base_path: BasePath

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return self.base_path.switch_forward(self, x, indices, sorted_indices=sorted_indices)


_ROUTED = {nn.QuantizedLinear: RoutedQuantizedLinear, nn.QuantizedEmbedding: RoutedQuantizedEmbedding,
           QuantizedSwitchLinear: RoutedQuantizedSwitchLinear}


def _routed_copy(module: nn.Module, base_path: BasePath) -> nn.Module:
    """The same object state under the routed subclass (no arrays copied), multiplying through `base_path`."""
    routed = _ROUTED[type(module)].__new__(_ROUTED[type(module)])
    routed.__dict__.update(module.__dict__)
    dict.update(routed, module)
    routed.base_path = base_path
    return routed


def route_frozen_quantized(model: nn.Module, base_path: BasePath) -> int:
    """Swap every plain frozen quantized layer for its routed subclass on `base_path`; returns how many."""
    swaps = [(name, _routed_copy(m, base_path)) for name, m in model.named_modules() if type(m) in _ROUTED]
    if swaps:
        model.update_modules(tree_unflatten(swaps))
        for _, m in swaps:
            base_path.warm(m)
    return len(swaps)
