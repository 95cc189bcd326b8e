"""The LoRA layer family: low-rank updates on Linear and Embedding bases.

Parameter names (`linear` / `embedding`, `lora_a`, `lora_b`) and shapes match
mlx-lm's, so adapters we save load in stock mlx-lm and theirs load in ours. Quantized
bases (QuantizedLinear, QuantizedEmbedding) are wrapped as they are and stay frozen;
`fuse` merges the update and requantizes with the base's own group size, bits and mode.
LoRA: Hu et al. 2021, h = W x + s * B A x with B = 0 at init (output unchanged at step 0).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn


def _dense_weight(layer: nn.Module) -> mx.array:
    """The base weight as a dense matrix, dequantizing a quantized layer."""
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return mx.dequantize(
            layer.weight, layer.scales, layer.biases,
            group_size=layer.group_size, bits=layer.bits, mode=layer.mode,
        )
    return layer.weight


def _logical_dims(layer: nn.Module) -> tuple[int, int]:
    """(rows, columns) of the unpacked weight: a quantized row packs 32 // bits values per word."""
    rows, cols = layer.weight.shape
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        cols = cols * 32 // layer.bits
    return rows, cols


class LoRALinear(nn.Module):
    """y = base(x) + scale * (dropout(x) @ lora_a) @ lora_b, base frozen."""

    @staticmethod
    def from_base(linear: nn.Module, r: int = 8, dropout: float = 0.0, scale: float = 20.0) -> "LoRALinear":
        output_dims, input_dims = _logical_dims(linear)
        layer = LoRALinear(input_dims, output_dims, r=r, dropout=dropout, scale=scale)
        layer.linear = linear
        return layer

    def __init__(self, input_dims: int, output_dims: int, r: int = 8, dropout: float = 0.0,
                 scale: float = 20.0, bias: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(input_dims, output_dims, bias=bias)
        self.dropout = nn.Dropout(p=dropout)
        self.scale = scale
        # mlx-lm's initialisation: A uniform in +-1/sqrt(in), B zero.
        bound = 1 / math.sqrt(input_dims)
        self.lora_a = mx.random.uniform(low=-bound, high=bound, shape=(input_dims, r))
        self.lora_b = mx.zeros(shape=(r, output_dims))

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        z = (self.dropout(x) @ self.lora_a) @ self.lora_b
        return y + (self.scale * z).astype(x.dtype)

    def delta(self) -> mx.array:
        """The dense update s * B^T A^T, shaped like the base weight (out, in)."""
        return (self.scale * self.lora_b.T) @ self.lora_a.T

    def fuse(self, dequantize: bool = False) -> nn.Module:
        """The base with the update merged in; requantized like the base unless `dequantize`."""
        base = self.linear
        weight = _dense_weight(base)
        out_dims, in_dims = weight.shape
        fused = nn.Linear(in_dims, out_dims, bias="bias" in base)
        fused.weight = weight + self.delta().astype(weight.dtype)
        if "bias" in base:
            fused.bias = base.bias
        if isinstance(base, nn.QuantizedLinear) and not dequantize:
            fused = nn.QuantizedLinear.from_linear(fused, base.group_size, base.bits, mode=base.mode)
        return fused


class LoRAEmbedding(nn.Module):
    """e = base[x] + scale * lora_a[x] @ lora_b; `as_linear` keeps a tied LM head consistent."""

    @staticmethod
    def from_base(embedding: nn.Module, r: int = 8, dropout: float = 0.0, scale: float = 20.0) -> "LoRAEmbedding":
        num_embeddings, dims = _logical_dims(embedding)
        layer = LoRAEmbedding(num_embeddings, dims, r=r, dropout=dropout, scale=scale)
        layer.embedding = embedding
        return layer

    def __init__(self, num_embeddings: int, dims: int, r: int = 8, dropout: float = 0.0,
                 scale: float = 20.0) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_embeddings, dims)
        self.dropout = nn.Dropout(p=dropout)
        self.scale = scale
        bound = 1 / math.sqrt(num_embeddings)
        self.lora_a = mx.random.uniform(low=-bound, high=bound, shape=(num_embeddings, r))
        self.lora_b = mx.zeros(shape=(r, dims))

    def __call__(self, x: mx.array) -> mx.array:
        y = self.embedding(x)
        z = self.dropout(self.lora_a[x] @ self.lora_b)
        return y + (self.scale * z).astype(y.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        # Tied head: logits = x @ (E + s A B)^T, the same adapted table as the lookup.
        y = self.embedding.as_linear(x)
        z = (self.dropout(x) @ self.lora_b.T) @ self.lora_a.T
        return y + (self.scale * z).astype(x.dtype)

    def delta(self) -> mx.array:
        """The dense update s * A B, shaped like the table (num_embeddings, dims)."""
        return (self.scale * self.lora_a) @ self.lora_b

    def fuse(self, dequantize: bool = False) -> nn.Module:
        """The table with the update merged in; requantized like the base unless `dequantize`."""
        base = self.embedding
        weight = _dense_weight(base)
        fused = nn.Embedding(*weight.shape)
        fused.weight = weight + self.delta().astype(weight.dtype)
        if isinstance(base, nn.QuantizedEmbedding) and not dequantize:
            fused = nn.QuantizedEmbedding.from_embedding(
                fused, group_size=base.group_size, bits=base.bits, mode=base.mode
            )
        return fused
