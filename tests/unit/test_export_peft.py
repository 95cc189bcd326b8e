"""PEFT export's tensor mapping: each adapted layer's output recomputed in numpy from the exported tensors
with PEFT's formulas equals meshtune's layer; the config's target_modules names exactly the adapted modules."""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from meshtune.adapters import apply_adapters
from meshtune.adapters.lora import LoRAEmbedding, LoRALinear
from meshtune.export.peft import PEFT_PREFIX, peft_config, peft_tensors


def _adapted(model_factory, kind: str, num_layers: int = -1, keys=None, tied: bool = True):
    model = model_factory(layers=3, dim=32, vocab=64, tied=tied)
    apply_adapters(model, fine_tune_type=kind, num_layers=num_layers, keys=keys, rank=4, scale=2.5, dropout=0.0)
    mx.random.seed(1)
    for _, layer in model.named_modules():
        if isinstance(layer, (LoRALinear, LoRAEmbedding)):  # trained-looking factors: B != 0, m moved off ||W||
            layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.1
            if "m" in layer:
                layer.m = layer.m * (1 + 0.1 * mx.random.normal(layer.m.shape))
    model.eval()
    return model


def _peft_linear(x: np.ndarray, weight: np.ndarray, bias, tensors: dict, key: str, scaling: float) -> np.ndarray:
    """PEFT's Linear forward (LoraLayer; DoraLinearLayer when a magnitude is there)."""
    a, b = tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"]  # (r, in), (out, r)
    base = x @ weight.T
    lora = (x @ a.T) @ b.T
    magnitude = tensors.get(f"{key}.lora_magnitude_vector")
    if magnitude is None:
        out = base + scaling * lora
    else:
        norm = np.linalg.norm(weight + scaling * (b @ a), axis=1)  # ||W + s B A||, one per output row
        scale = magnitude / norm
        out = base + (scale - 1) * base + scale * lora * scaling
    return out + (bias if bias is not None else 0)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_every_exported_linear_gives_meshtune_s_output_under_peft_s_formula(model_factory, kind):
    model = _adapted(model_factory, kind)
    config = peft_config({"fine_tune_type": kind, "lora_parameters": {"rank": 4, "scale": 2.5}}, model, "base")
    assert config["r"] == 4 and config["lora_alpha"] == 10.0 and config["use_dora"] == (kind == "dora")
    scaling = config["lora_alpha"] / config["r"]
    tensors = {k: np.array(v) for k, v in peft_tensors(model).items()}
    checked = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, LoRALinear):
            continue
        x_in = np.random.default_rng(checked).normal(size=(5, layer.lora_a.shape[0])).astype(np.float32)
        ours = np.array(layer(mx.array(x_in)))
        bias = np.array(layer.linear.bias) if "bias" in layer.linear else None
        theirs = _peft_linear(x_in, np.array(layer.linear.weight), bias, tensors, PEFT_PREFIX + name, scaling)
        np.testing.assert_allclose(theirs, ours, rtol=2e-4, atol=2e-5, err_msg=name)
        checked += 1
    assert checked == 3 * 7
    per_layer = 3 if kind == "dora" else 2
    assert len(tensors) == checked * per_layer
    assert all(k.startswith("base_model.model.model.layers.") for k in tensors)
    assert {k.split(".")[-2] + "." + k.split(".")[-1] for k in tensors} >= {"lora_A.weight", "lora_B.weight"}


def test_an_untied_embedding_maps_to_peft_s_embedding_names(model_factory):
    model = _adapted(model_factory, "lora", keys=["model.embed_tokens", "self_attn.q_proj"], tied=False)
    tensors = {k: np.array(v) for k, v in peft_tensors(model).items()}
    layer = model.model.embed_tokens
    ids = np.array([[3, 7, 63]])
    key = PEFT_PREFIX + "model.embed_tokens"
    # PEFT's Embedding: E[x] + scaling * (lora_embedding_A^T[x]) @ lora_embedding_B^T
    theirs = (np.array(layer.embedding.weight)[ids]
              + 2.5 * tensors[f"{key}.lora_embedding_A"].T[ids] @ tensors[f"{key}.lora_embedding_B"].T)
    np.testing.assert_allclose(theirs, np.array(layer(mx.array(ids))), rtol=1e-5, atol=1e-6)


def test_target_modules_full_matches_exactly_the_adapted_modules(model_factory):
    model = _adapted(model_factory, "lora", num_layers=2, keys=["self_attn.q_proj", "mlp.down_proj"])
    pattern = peft_config({"fine_tune_type": "lora"}, model, "base")["target_modules"]
    adapted = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert adapted == {f"model.layers.{i}.{leaf}" for i in (1, 2) for leaf in ("self_attn.q_proj", "mlp.down_proj")}
    # PEFT full-matches a string target_modules against each module name of the transformers model.
    every_name = {n for n, _ in model.named_modules()} | {f"model.layers.0.{l}" for l in ("self_attn.q_proj",)}
    assert {n for n in every_name if re.fullmatch(pattern, n)} == adapted


def test_what_peft_cannot_express_is_refused_with_the_way_out(model_factory):
    tied = _adapted(model_factory, "lora", keys=["model.embed_tokens"])
    with pytest.raises(ValueError, match="ties its head to the embedding.*--format hf"):
        peft_tensors(tied)
    with pytest.raises(ValueError, match="^fine_tune_type full: --format peft exports lora and dora"):
        peft_config({"fine_tune_type": "full"}, nn.Module(), "base")
