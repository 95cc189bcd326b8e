"""The LoRA layer family: low-rank updates on Linear and Embedding bases.

Parameter names (`linear` / `embedding`, `lora_a`, `lora_b`) and shapes match
mlx-lm's, so adapters we save load in stock mlx-lm and theirs load in ours. Quantized
bases (QuantizedLinear, QuantizedEmbedding) are wrapped as they are and stay frozen;
their products go through the layer's `base_path` (base_path.BasePath: quantized kernel or
dequantize-then-dense, by token count). `fuse` merges the update and requantizes with the base's own group
size, bits and mode. DoRA (dora.py) is a variant of these classes that overrides only
`set_base` (the magnitude), the forward and `_merge` (the fused weight).
LoRA: Hu et al. 2021, h = W x + s * B A x with B = 0 at init (output unchanged at step 0).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from .adapted_linear import lora_linear
from .base_path import BasePath, dequantized_weight, is_quantized


def logical_dims(layer: nn.Module) -> tuple[int, ...]:
    """Shape of the unpacked weight: a quantized row packs 32 // bits values per word."""
    *lead, cols = layer.weight.shape
    if is_quantized(layer):
        cols = cols * 32 // layer.bits
    return (*lead, cols)


def requantize_like(fused: nn.Module, base: nn.Module, dequantize: bool) -> nn.Module:
    """Quantize a fused dense layer as its base was (group size, bits, mode) unless `dequantize`."""
    if not is_quantized(base) or dequantize:
        return fused
    if isinstance(base, nn.QuantizedLinear):
        return nn.QuantizedLinear.from_linear(fused, base.group_size, base.bits, mode=base.mode)
    if isinstance(base, nn.QuantizedEmbedding):
        return nn.QuantizedEmbedding.from_embedding(fused, group_size=base.group_size, bits=base.bits,
                                                    mode=base.mode)
    return fused.to_quantized(group_size=base.group_size, bits=base.bits, mode=base.mode,
                              global_scale=base.get("global_scale") is not None)


def while_frozen(module: nn.Module, slot: str, dtype: mx.Dtype, build: Callable[[], Any]) -> Any:
    """A value derived from the adapter arrays, kept until one of them is replaced.

    Outside training the adapter is constant, so inference reuses its derived factors
    (cast to the activations' dtype, scale folded in) instead of rebuilding them per
    token. Holding the keyed arrays keeps their ids from being reused while cached.
    """
    key = tuple(module[k] for k in ("lora_a", "lora_b", "m") if k in module)
    cached = module.__dict__.get(slot)
    if cached is None or cached[1] != dtype or any(a is not b for a, b in zip(cached[0], key)):
        cached = module.__dict__[slot] = (key, dtype, build())
    return cached[2]


class LowRankAdapter(nn.Module):
    """What every LoRA class shares: built around a frozen base, fused as W + delta().

    `base_path` (not a parameter) is how the base multiplies: the run's BasePath where from_base
    is given one (apply_adapters gives every layer of a model the same), else the layer's own."""

    def __init__(self) -> None:
        super().__init__()
        self.base_path = BasePath()

    @classmethod
    def _around(cls, base: nn.Module, *dims: int, r: int, dropout: float, scale: float, settle: bool = True,
                base_path: BasePath | None = None) -> Any:
        layer = cls(*dims, r=r, dropout=dropout, scale=scale)
        layer.set_base(base)
        if base_path is not None:
            layer.base_path = base_path
        if settle:
            layer.settle()
        layer.base_path.warm(base)  # the quantized/dense crossover is measured now, not in the first step
        return layer

    def settle(self) -> None:
        """Compute what the layer derives from its base once (DoRA's row norms); LoRA derives nothing."""

    def _merge(self, weight: mx.array) -> mx.array:
        return weight + self.delta().astype(weight.dtype)


class LoRALinear(LowRankAdapter):
    """y = base(x) + scale * (dropout(x) @ lora_a) @ lora_b, base frozen."""

    @classmethod
    def from_base(cls, linear: nn.Module, r: int = 8, dropout: float = 0.0, scale: float = 20.0,
                  settle: bool = True, base_path: BasePath | None = None) -> "LoRALinear":
        output_dims, input_dims = logical_dims(linear)
        return cls._around(linear, input_dims, output_dims, r=r, dropout=dropout, scale=scale, settle=settle,
                           base_path=base_path)

    def __init__(self, input_dims: int, output_dims: int, r: int = 8, dropout: float = 0.0,
                 scale: float = 20.0, bias: bool = False) -> None:
        super().__init__()
        self.set_base(nn.Linear(input_dims, output_dims, bias=bias))
        self.dropout = nn.Dropout(p=dropout)
        self.dropout_rate = dropout  # 0: the branch takes x itself (a DoRA step may then merge: step_norms.py)
        self.scale = scale
        # mlx-lm's initialisation: A uniform in +-1/sqrt(in), B zero.
        bound = 1 / math.sqrt(input_dims)
        self.lora_a = mx.random.uniform(low=-bound, high=bound, shape=(input_dims, r))
        self.lora_b = mx.zeros(shape=(r, output_dims))

    def set_base(self, linear: nn.Module) -> None:
        """Wrap a (frozen) Linear or QuantizedLinear."""
        self.linear = linear

    def lora_out(self, x: mx.array) -> mx.array:
        """The low-rank branch s * (x A) B, in x's dtype."""
        if not self.training:
            # Factors in x's dtype (no float32 promotion of bf16 activations per token);
            # for float32 the same operations as training, so logits match stock bit for bit.
            a, b = while_frozen(self, "_lora_factors", x.dtype, lambda: (
                self.lora_a.astype(x.dtype), self.lora_b.astype(x.dtype)))
            return (self.scale * ((x @ a) @ b)).astype(x.dtype)
        z = (self.dropout(x) @ self.lora_a) @ self.lora_b
        return (self.scale * z).astype(x.dtype)

    def __call__(self, x: mx.array) -> mx.array:
        dense = self.base_path.dense_weight_for(self.linear, x.size // x.shape[-1]) if self.training else None
        if dense is None:
            return self.base_path.linear_forward(self.linear, x) + self.lora_out(x)
        # Training on a dense (or dequantized) weight: the product with its own backward.
        y = lora_linear(x, dense, self.lora_a, self.lora_b, self.scale, x_lora=self.dropout(x))
        return y + self.linear["bias"] if "bias" in self.linear else y

    def delta(self) -> mx.array:
        """The dense update s * B^T A^T, shaped like the base weight (out, in)."""
        return (self.scale * self.lora_b.T) @ self.lora_a.T

    def fuse(self, dequantize: bool = False) -> nn.Module:
        """The base with the update merged in; requantized like the base unless `dequantize`."""
        base = self.linear
        weight = self._merge(dequantized_weight(base))
        out_dims, in_dims = weight.shape
        fused = nn.Linear(in_dims, out_dims, bias="bias" in base)
        fused.weight = weight
        if "bias" in base:
            fused.bias = base.bias
        return requantize_like(fused, base, dequantize)


class LoRAEmbedding(LowRankAdapter):
    """e = base[x] + scale * lora_a[x] @ lora_b; `as_linear` keeps a tied LM head consistent."""

    @classmethod
    def from_base(cls, embedding: nn.Module, r: int = 8, dropout: float = 0.0, scale: float = 20.0,
                  settle: bool = True, base_path: BasePath | None = None) -> "LoRAEmbedding":
        return cls._around(embedding, *logical_dims(embedding), r=r, dropout=dropout, scale=scale, settle=settle,
                           base_path=base_path)

    def __init__(self, num_embeddings: int, dims: int, r: int = 8, dropout: float = 0.0,
                 scale: float = 20.0) -> None:
        super().__init__()
        self.set_base(nn.Embedding(num_embeddings, dims))
        self.dropout = nn.Dropout(p=dropout)
        self.scale = scale
        bound = 1 / math.sqrt(num_embeddings)
        self.lora_a = mx.random.uniform(low=-bound, high=bound, shape=(num_embeddings, r))
        self.lora_b = mx.zeros(shape=(r, dims))

    def set_base(self, embedding: nn.Module) -> None:
        """Wrap a (frozen) Embedding or QuantizedEmbedding."""
        self.embedding = embedding

    def __call__(self, x: mx.array) -> mx.array:
        y = self.embedding(x)
        z = self.dropout(self.lora_a[x] @ self.lora_b)
        return y + (self.scale * z).astype(y.dtype)

    def lora_head_out(self, x: mx.array) -> mx.array:
        """The low-rank branch of the tied head, s * (x B^T) A^T, in x's dtype."""
        z = (self.dropout(x) @ self.lora_b.T) @ self.lora_a.T
        return (self.scale * z).astype(x.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        # Tied head: logits = x @ (E + s A B)^T, the same adapted table as the lookup.
        return self.base_path.linear_forward(self.embedding, x) + self.lora_head_out(x)

    def delta(self) -> mx.array:
        """The dense update s * A B, shaped like the table (num_embeddings, dims)."""
        return (self.scale * self.lora_a) @ self.lora_b

    def fuse(self, dequantize: bool = False) -> nn.Module:
        """The table with the update merged in; requantized like the base unless `dequantize`."""
        base = self.embedding
        weight = self._merge(dequantized_weight(base))
        fused = nn.Embedding(*weight.shape)
        fused.weight = weight
        return requantize_like(fused, base, dequantize)
