"""Frozen quantized layers without adapters take the measured base path, names unchanged."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from meshtune.adapters import BasePath, apply_adapters
from meshtune.adapters.frozen import RoutedQuantizedEmbedding, RoutedQuantizedLinear


@pytest.mark.parametrize("mode", ["quantized", "dequantized"])
@pytest.mark.parametrize("tied", [False, True])
def test_frozen_quantized_layers_are_routed(model_factory, mode, tied):
    model = model_factory(layers=2, dim=64, vocab=128, tied=tied)
    nn.quantize(model, group_size=32, bits=4)
    tokens = mx.array([[1, 2, 3, 4, 5, 6]])
    want = model(tokens)
    names = {k: v.shape for k, v in tree_flatten(model.parameters())}
    paths = BasePath(mode)
    apply_adapters(model, fine_tune_type="lora", num_layers=1, keys=None, rank=4, scale=1.0, dropout=0.0,
                   base_path=paths)
    # Block 0 has no adapters: its layers and the head are routed, and keep their names.
    assert isinstance(model.model.layers[0].self_attn.q_proj, RoutedQuantizedLinear)
    head = model.model.embed_tokens if tied else model.lm_head
    assert isinstance(head, RoutedQuantizedEmbedding if tied else RoutedQuantizedLinear)
    base_names = {k: v.shape for k, v in tree_flatten(model.parameters()) if "lora_" not in k}
    assert {k.replace(".linear.", "."): v for k, v in base_names.items()} == names
    # The head multiplies through the run's base path: the dequantized weight's product or quantized_matmul.
    assert head.base_path is paths and model.model.layers[1].self_attn.q_proj.base_path is paths
    assert paths.use_dequantized(head, tokens.size) == (mode == "dequantized")
    got = model(tokens)
    exact = mode == "quantized"
    assert mx.array_equal(got, want) if exact else mx.allclose(got, want, atol=1e-3)
