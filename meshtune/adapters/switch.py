"""LoRA on mixture-of-experts layers: one low-rank update per expert of a SwitchLinear.

Layout matches mlx-lm's LoRASwitchLinear (`linear`, `lora_a` (E, r, in), `lora_b`
(E, out, r)) so stock mlx-lm loads the adapters we save. The base runs on the model's
own gather kernels (`gather_mm` / `gather_qmm`, with the router's `indices` and
`sorted_indices`), through the layer's `base_path` for quantized experts; the update for the
routed experts is two more gathers, never a dense per-expert weight. DoRA's variant
(one magnitude per expert and output row) is `DoRASwitchLinear` in dora.py.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchLinear

from .base_path import BasePath, dequantized_weight
from .lora import LowRankAdapter, logical_dims, requantize_like


class LoRASwitchLinear(LowRankAdapter):
    """y_e = base_e(x) + scale * lora_b[e] @ lora_a[e] @ x for each routed expert e."""

    @classmethod
    def from_base(cls, linear: nn.Module, r: int = 8, dropout: float = 0.0,
                  scale: float = 20.0, settle: bool = True,
                  base_path: BasePath | None = None) -> "LoRASwitchLinear":
        num_experts, output_dims, input_dims = logical_dims(linear)
        return cls._around(linear, input_dims, output_dims, num_experts, r=r, dropout=dropout, scale=scale,
                           settle=settle, base_path=base_path)

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, r: int = 8,
                 dropout: float = 0.0, scale: float = 20.0, bias: bool = False) -> None:
        super().__init__()
        self.set_base(SwitchLinear(input_dims, output_dims, num_experts, bias=bias))
        self.dropout = nn.Dropout(p=dropout)
        self.scale = scale
        self.num_experts = num_experts
        # mlx-lm's initialisation and layout: A uniform in +-1/sqrt(in), B zero.
        bound = 1 / math.sqrt(input_dims)
        self.lora_a = mx.random.uniform(low=-bound, high=bound, shape=(num_experts, r, input_dims))
        self.lora_b = mx.zeros(shape=(num_experts, output_dims, r))

    def set_base(self, linear: nn.Module) -> None:
        """Wrap a (frozen) SwitchLinear or QuantizedSwitchLinear."""
        self.linear = linear

    def lora_out(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        """s * B_e (A_e x) for each token's routed experts, in x's dtype."""
        z = mx.gather_mm(self.dropout(x), self.lora_a.swapaxes(-1, -2), rhs_indices=indices,
                         sorted_indices=sorted_indices)
        z = mx.gather_mm(z, self.lora_b.swapaxes(-1, -2), rhs_indices=indices,
                         sorted_indices=sorted_indices)
        return (self.scale * z).astype(x.dtype)

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = self.base_path.switch_forward(self.linear, x, indices, sorted_indices=sorted_indices)
        return y + self.lora_out(x, indices, sorted_indices)

    def delta(self) -> mx.array:
        """The dense update s * B_e A_e per expert, shaped like the base weight (E, out, in)."""
        return (self.scale * self.lora_b) @ self.lora_a

    def fuse(self, dequantize: bool = False) -> nn.Module:
        """A SwitchLinear with the update merged; requantized (to_quantized) unless `dequantize`."""
        base = self.linear
        weight = self._merge(dequantized_weight(base))
        num_experts, out_dims, in_dims = weight.shape
        fused = SwitchLinear(in_dims, out_dims, num_experts, bias="bias" in base)
        fused.weight = weight
        if "bias" in base:
            fused.bias = base.bias
        return requantize_like(fused, base, dequantize)
