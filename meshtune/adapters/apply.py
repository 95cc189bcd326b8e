"""Targeting, saving, loading and fusing adapters, in mlx-lm's layout.

Targeting follows mlx-lm so that stock `mlx_lm.load(model, adapter_path=...)` rebuilds
exactly the layers we trained: `num_layers` picks the last N transformer blocks,
`keys` names modules relative to a block (e.g. `self_attn.q_proj`) or by full path
outside the blocks (e.g. `model.embed_tokens`); with no keys every adaptable layer in
the chosen blocks is adapted. `full` unfreezes the chosen layers instead.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .lora import LoRAEmbedding, LoRALinear

ADAPTABLE = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)
ADAPTER_FILE = "adapters.safetensors"
CONFIG_FILE = "adapter_config.json"
ADAPTER_LEAVES = {"lora_a", "lora_b", "m"}


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no `layers` list of transformer blocks; "
                         "meshtune targets mlx-lm models, whose modules expose `model.layers`")
    return list(layers)


def chosen_blocks(model: nn.Module, num_layers: int) -> list[nn.Module]:
    """The last `num_layers` blocks (-1: all), with a clear error when there are fewer."""
    blocks = _blocks(model)
    if num_layers > len(blocks):
        raise ValueError(f"adapter.num_layers={num_layers} but the model has {len(blocks)} blocks; "
                         f"use a value <= {len(blocks)} or -1 for all")
    return blocks if num_layers < 0 else blocks[len(blocks) - num_layers:]


def _check_keys(model: nn.Module, keys: list[str]) -> None:
    """Every key must name a module in a block or in the model; suggest the nearest otherwise."""
    block_names = {n for n, _ in _blocks(model)[0].named_modules()} if keys else set()
    for block in _blocks(model)[1:] if keys else []:
        block_names |= {n for n, _ in block.named_modules()}
    model_names = {n for n, _ in model.named_modules()}
    for key in keys:
        if key not in block_names and key not in model_names:
            near = difflib.get_close_matches(key, sorted(block_names | model_names), n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ValueError(f"adapter.keys: '{key}' names no module of the model{hint}")


def _to_lora(module: nn.Module, rank: int, scale: float, dropout: float) -> nn.Module:
    if isinstance(module, (nn.Linear, nn.QuantizedLinear)):
        return LoRALinear.from_base(module, r=rank, scale=scale, dropout=dropout)
    if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)):
        return LoRAEmbedding.from_base(module, r=rank, scale=scale, dropout=dropout)
    raise ValueError(f"cannot put LoRA on a {type(module).__name__}; adapter.keys may name only "
                     "Linear, QuantizedLinear, Embedding or QuantizedEmbedding layers")


def _target_modules(model: nn.Module, num_layers: int, keys: list[str] | None,
                    visit: Callable[[nn.Module, str, nn.Module], None]) -> int:
    """Call visit(owner, name, module) on every targeted module; returns how many."""
    count = 0
    for block in chosen_blocks(model, num_layers):
        for name, module in block.named_modules():
            if (keys is None and isinstance(module, ADAPTABLE)) or (keys is not None and name in keys):
                visit(block, name, module)
                count += 1
    for name, module in model.named_modules():
        if keys is not None and name in keys:
            visit(model, name, module)
            count += 1
    return count


def apply_adapters(model: nn.Module, *, fine_tune_type: str, num_layers: int, keys: list[str] | None,
                   rank: int, scale: float, dropout: float) -> int:
    """Freeze the model, then add LoRA layers (or unfreeze for `full`); returns layers touched."""
    if fine_tune_type == "dora":
        raise ValueError("adapter.fine_tune_type=dora is not available yet; use lora or full")
    if keys:
        _check_keys(model, keys)
    model.freeze()
    replacements: list[tuple[nn.Module, str, nn.Module]] = []

    def visit(owner: nn.Module, name: str, module: nn.Module) -> None:
        if fine_tune_type == "full":
            module.unfreeze()
        else:
            replacements.append((owner, name, _to_lora(module, rank, scale, dropout)))

    count = _target_modules(model, num_layers, keys, visit)
    for owner, name, new in replacements:
        owner.update_modules(tree_unflatten([(name, new)]))
    if count == 0:
        raise ValueError(f"no layers matched adapter.keys={keys} in the last {num_layers} blocks; "
                         "name modules relative to a block, e.g. self_attn.q_proj")
    return count


def trainable_parameters(model: nn.Module) -> dict[str, mx.array]:
    """Flat name -> array of what training changes (what adapters.safetensors holds)."""
    return dict(tree_flatten(model.trainable_parameters()))


def mlx_lm_adapter_config(adapter: Any, *, model_path: str, data_path: str,
                          extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """adapter_config.json as stock mlx-lm reads it, plus the base model and data folder."""
    lora: dict[str, Any] = {"rank": adapter.rank, "scale": adapter.scale, "dropout": adapter.dropout}
    if adapter.keys is not None:
        lora["keys"] = list(adapter.keys)
    config = {
        "fine_tune_type": adapter.fine_tune_type,
        "num_layers": adapter.num_layers,
        "lora_parameters": lora,
        "model": model_path,
        "data": data_path,
    }
    config.update(extra or {})
    return config


def load_adapters(model: nn.Module, adapter_path: str | Path) -> nn.Module:
    """Apply the adapters described by adapter_path/adapter_config.json and load their weights."""
    folder = Path(adapter_path)
    config_file = folder / CONFIG_FILE
    if not config_file.exists():
        raise ValueError(f"{config_file} not found; point --adapter-path at a folder written by "
                         "meshtune train or mlx_lm.lora")
    config = json.loads(config_file.read_text())
    lora = config.get("lora_parameters") or {}
    apply_adapters(model, fine_tune_type=config.get("fine_tune_type", "lora"),
                   num_layers=config["num_layers"], keys=lora.get("keys"),
                   rank=lora.get("rank", 8), scale=lora.get("scale", 20.0),
                   dropout=lora.get("dropout", 0.0))
    load_trainable(model, folder / ADAPTER_FILE)
    return model


def load_trainable(model: nn.Module, weights_file: Path) -> None:
    """Load saved trainable weights, naming every tensor that does not fit."""
    if not weights_file.exists():
        raise ValueError(f"{weights_file} not found; train first or point at the right folder")
    weights = mx.load(str(weights_file))
    expected = trainable_parameters(model)
    problems = [f"{k}: not a trainable parameter of this model" for k in weights if k not in expected]
    problems += [f"{k}: shape {tuple(w.shape)} != {tuple(expected[k].shape)}"
                 for k, w in weights.items() if k in expected and w.shape != expected[k].shape]
    problems += [f"{k}: missing from the file" for k in expected if k not in weights]
    if problems:
        raise ValueError(f"{weights_file} does not match the model: " + "; ".join(problems[:5])
                         + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""))
    model.load_weights(list(weights.items()), strict=False)


def fuse_adapters(model: nn.Module, dequantize: bool = False) -> int:
    """Merge every adapter layer into its base in place; returns how many were fused."""
    fused = [(n, m.fuse(dequantize=dequantize)) for n, m in model.named_modules() if hasattr(m, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))
    return len(fused)
