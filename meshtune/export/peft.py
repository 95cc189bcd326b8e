"""LoRA and DoRA adapters as a PEFT folder: `adapter_config.json` with PEFT's keys and
`adapter_model.safetensors` with Hugging Face module names, for transformers, vLLM and TGI.

mlx-lm's model tree names modules as transformers does for the families it shares (e.g.
`model.layers.N.self_attn.q_proj`); `peft_tensors` gives each layer's mapping. Expert
(SwitchLinear) adapters, DoRA on an embedding and full fine-tuning have no PEFT form here; each is
one line naming what to do instead.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from ..adapters.dora import DoRAEmbedding, DoRALinear
from ..adapters.lora import LoRAEmbedding, LoRALinear
from ..adapters.switch import LoRASwitchLinear
from ..run_dir import RunDir

PEFT_PREFIX = "base_model.model."
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


def _adapted(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, layer) of every adapter layer, refusing those PEFT has no form for."""
    modules = model.named_modules()
    # Without an lm_head the head is tied to the embedding, and a LoRAEmbedding adapts both.
    untied = any(name == "lm_head" for name, _ in modules)
    found = []
    for name, module in modules:
        if isinstance(module, LoRASwitchLinear):
            raise ValueError(f"{name}: adapters on mixture-of-experts layers have no PEFT form; export the fused "
                             "model instead (meshtune export --format hf)")
        if isinstance(module, DoRAEmbedding):
            raise ValueError(f"{name}: DoRA on an embedding has no PEFT form here; export the fused model "
                             "(meshtune export --format hf), or train without the embedding in --adapter.keys")
        if isinstance(module, LoRAEmbedding) and not untied:
            raise ValueError(f"{name}: this model ties its head to the embedding, which meshtune adapts with it and "
                             "PEFT does not; export the fused model (meshtune export --format hf)")
        if isinstance(module, (LoRALinear, LoRAEmbedding)):
            found.append((name, module))
    if not found:
        raise ValueError("no LoRA or DoRA layers in the model; --format peft exports lora and dora runs (a full "
                         "fine-tuning run exports with --format hf)")
    return found


def peft_tensors(model: nn.Module) -> dict[str, mx.array]:
    """PEFT's state dict for the model's adapter layers, in their own dtype (the mapping: `_tensors`)."""
    return _tensors(_adapted(model))


def _tensors(adapted: list[tuple[str, nn.Module]]) -> dict[str, mx.array]:
    """peft_tensors of the `_adapted` layers.

    - Linear: meshtune computes y = W x + s (x A) B with A (in, r), B (r, out); PEFT computes
      y = W x + (lora_alpha / r) B' A' x with lora_A.weight A' (r, in), lora_B.weight B' (out, r).
      So A' = A^T, B' = B^T and lora_alpha = s r.
    - DoRA (Liu et al. 2024, section 4.1; PEFT's DoraLinearLayer): both compute
      y = m / ||W + s B'A'||_row * (W x + s B' A' x) + bias; `m` is PEFT's
      `lora_magnitude_vector`, saved under that name without a `.weight` suffix, as PEFT saves it.
    - Embedding (untied head only): PEFT's lora_embedding_A (r, vocab) = A^T and
      lora_embedding_B (dims, r) = B^T. A tied head is refused: meshtune adapts the head with the
      table, PEFT only the lookup.
    """
    tensors: dict[str, mx.array] = {}
    for name, layer in adapted:
        key = PEFT_PREFIX + name
        if isinstance(layer, LoRAEmbedding):
            tensors[f"{key}.lora_embedding_A"] = layer.lora_a.T
            tensors[f"{key}.lora_embedding_B"] = layer.lora_b.T
            continue
        tensors[f"{key}.lora_A.weight"] = layer.lora_a.T
        tensors[f"{key}.lora_B.weight"] = layer.lora_b.T
        if isinstance(layer, DoRALinear):
            tensors[f"{key}.lora_magnitude_vector"] = layer.m
    return {k: mx.contiguous(v) for k, v in tensors.items()}


def _target_pattern(names: list[str]) -> str:
    """One regex PEFT full-matches against module names: exactly the adapted modules."""
    by_block: dict[tuple[str, str], set[str]] = defaultdict(set)
    loose = []
    for name in names:
        found = re.match(r"^(.*?)\.(\d+)\.(.+)$", name)
        if found:
            by_block[(found.group(1), found.group(3))].add(found.group(2))
        else:
            loose.append(re.escape(name))
    # Modules that share a block path and a set of block indices are written once.
    by_indices: dict[tuple[str, tuple[str, ...]], list[str]] = defaultdict(list)
    for (blocks, leaf), indices in by_block.items():
        by_indices[(blocks, tuple(sorted(indices, key=int)))].append(re.escape(leaf))
    parts = [f"{re.escape(blocks)}\\.(?:{'|'.join(indices)})\\.(?:{'|'.join(sorted(leaves))})"
             for (blocks, indices), leaves in sorted(by_indices.items())]
    return "|".join(parts + sorted(loose))


def _fine_tune_type(adapter_config: dict[str, Any]) -> str:
    """The run's fine_tune_type, refusing those PEFT has no form for."""
    kind = adapter_config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise ValueError(f"fine_tune_type {kind}: --format peft exports lora and dora adapters; a full fine-tuning "
                         "run exports as a model with --format hf")
    return kind


def peft_config(adapter_config: dict[str, Any], model: nn.Module, base_model: str) -> dict[str, Any]:
    """PEFT's adapter_config.json for a meshtune (or mlx_lm.lora) run's adapter_config.json."""
    _fine_tune_type(adapter_config)  # first: a full run has no LoRA layers, and this line says what to do
    return _config(adapter_config, _adapted(model), base_model)


def _config(adapter_config: dict[str, Any], adapted: list[tuple[str, nn.Module]], base_model: str) -> dict[str, Any]:
    """peft_config for the `_adapted` layers."""
    kind = _fine_tune_type(adapter_config)
    lora = adapter_config.get("lora_parameters") or {}
    rank, scale = int(lora.get("rank", 8)), float(lora.get("scale", 20.0))
    names = [name for name, _ in adapted]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": scale * rank,  # PEFT scales by lora_alpha / r; meshtune by `scale`
        "lora_dropout": float(lora.get("dropout", 0.0)),
        "target_modules": _target_pattern(names),
        "use_dora": kind == "dora",
        "use_rslora": False,
        "fan_in_fan_out": False,
        "bias": "none",
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def export_peft(adapter_path: str | Path, save_path: str | Path, *, model_path: str, base_model: str | None = None,
                overwrite: bool = False, log: Callable[[str], None] = print) -> Path:
    """Write the run's adapters as a PEFT folder in `save_path`; `base_model` is the name PEFT records
    (default `model_path`: give the Hugging Face id of the model the MLX base was converted from)."""
    from ..inference import check_save_path, load_for_inference

    check_save_path(save_path, overwrite, "the PEFT adapters")
    adapter_config = json.loads(RunDir(adapter_path).config.read_text())
    _fine_tune_type(adapter_config)  # the one-line refusal, before the model loads
    model, _ = load_for_inference(model_path, adapter_path)
    adapted = _adapted(model)  # one walk of the model for the config and the tensors
    config = _config(adapter_config, adapted, base_model or model_path)
    tensors = _tensors(adapted)
    target = Path(save_path)
    target.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(target / PEFT_WEIGHTS_FILE), tensors, metadata={"format": "pt"})
    (target / PEFT_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    kind = "DoRA" if config["use_dora"] else "LoRA"
    log(f"exported {kind} adapters on {len({k.rsplit('.lora_', 1)[0] for k in tensors})} layers as PEFT "
        f"(r {config['r']}, lora_alpha {config['lora_alpha']:g}) into {save_path}")
    return target
