"""Targeting, saving, loading and fusing adapters, in mlx-lm's layout.

Targeting follows mlx-lm so that stock `mlx_lm.load(model, adapter_path=...)` rebuilds
exactly the layers we trained: `num_layers` picks the last N transformer blocks,
`keys` names modules relative to a block (e.g. `self_attn.q_proj`) or by full path
outside the blocks (e.g. `model.embed_tokens`); with no keys every adaptable layer in
the chosen blocks is adapted (Linear, Embedding and mixture-of-experts SwitchLinear,
quantized or not). `full` unfreezes the chosen layers instead. `dora` puts the DoRA
variant on the same layers; stock mlx-lm has no DoRA for experts (nor for a quantized
embedding), so the saved config says when it cannot load a run's adapters.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from ..config.resume import same_source
from ..config.sections import full_needs_dense
from .base_path import BasePath
from ..run_dir import CheckpointDir, RunDir
from .dora import DoRAEmbedding, DoRALinear, DoRASwitchLinear, settle_norms
from .frozen import route_frozen_quantized
from .lora import LoRAEmbedding, LoRALinear
from .switch import LoRASwitchLinear

FINE_TUNE_TYPES = ("lora", "dora", "full")
ADAPTABLE = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding, SwitchLinear,
             QuantizedSwitchLinear)
# (base types, LoRA class, DoRA class), in the order they are tried.
FAMILY = (((nn.Linear, nn.QuantizedLinear), LoRALinear, DoRALinear),
          ((SwitchLinear, QuantizedSwitchLinear), LoRASwitchLinear, DoRASwitchLinear),
          ((nn.Embedding, nn.QuantizedEmbedding), LoRAEmbedding, DoRAEmbedding))


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no `layers` list of transformer blocks; "
                         "meshtune targets mlx-lm models, whose modules expose `model.layers`")
    return list(layers)


def block_count(model: nn.Module) -> int:
    """How many transformer blocks the model has."""
    return len(_blocks(model))


def chosen_blocks(model: nn.Module, num_layers: int) -> list[nn.Module]:
    """The last `num_layers` blocks; -1, or more than the model has, chooses all (as mlx-lm's loader slices)."""
    blocks = _blocks(model)
    return blocks if num_layers < 0 or num_layers >= len(blocks) else blocks[len(blocks) - num_layers:]


def _module_names(model: nn.Module) -> tuple[set[str], set[str]]:
    """What adapter.keys may name: a module's path inside a block, or in the model."""
    return {n for block in _blocks(model) for n, _ in block.named_modules()}, {n for n, _ in model.named_modules()}


def _check_keys(model: nn.Module, keys: list[str]) -> None:
    """Every key must name a module in a block or in the model; suggest the nearest otherwise
    (a bare layer name, PEFT's habit, gets the block paths that end with it)."""
    in_block, in_model = _module_names(model)
    for key in keys:
        if key not in in_block | in_model:
            near = (sorted(n for n in in_block if n.endswith(f".{key}"))[:3]
                    or difflib.get_close_matches(key, sorted(in_block | in_model), n=1))
            hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
            if key == "lm_head" and "model.embed_tokens" in in_model:
                hint = "; this model ties its head to 'model.embed_tokens': name that"
            raise ValueError(f"adapter.keys: '{key}' names no module of the model{hint}")


def _to_adapter(module: nn.Module, variant: str, rank: int, scale: float, dropout: float,
                base_path: BasePath) -> nn.Module:
    for bases, lora_cls, dora_cls in FAMILY:
        if isinstance(module, bases):
            cls = dora_cls if variant == "dora" else lora_cls
            return cls.from_base(module, r=rank, scale=scale, dropout=dropout, settle=False, base_path=base_path)
    raise ValueError(f"cannot put {variant} on a {type(module).__name__}; adapter.keys may name only "
                     "Linear, Embedding or SwitchLinear layers (quantized or not)")


def stock_unloadable(model: nn.Module) -> dict[str, str]:
    """path -> class of adapter layers that stock mlx-lm cannot rebuild (empty: it loads all)."""
    # Stock raises on DoRA for SwitchLinear, and its DoRAEmbedding reads a quantized
    # table's packed words as the weight (wrong shapes for lora_b, m and the tied head).
    return dict(sorted((name, type(m).__name__) for name, m in model.named_modules()
                       if isinstance(m, DoRASwitchLinear)
                       or (isinstance(m, DoRAEmbedding) and isinstance(m.embedding, nn.QuantizedEmbedding))))


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
                   rank: int, scale: float, dropout: float, lazy: bool = False,
                   base_path: BasePath | None = None) -> int:
    """Freeze the model, then add LoRA or DoRA layers (or unfreeze for `full`); returns layers touched.

    Every adapter layer and every frozen quantized layer multiplies its base through `base_path`
    (the run's; by default one for this model, "auto"). With `lazy` nothing of the base is read:
    DoRA's row norms stay unevaluated until `settle_norms` (a pipeline stage calls it once it has
    dropped the other stages' blocks)."""
    if fine_tune_type not in FINE_TUNE_TYPES:
        raise ValueError(f"adapter.fine_tune_type={fine_tune_type!r} is unknown; use lora, dora or full")
    if keys:
        _check_keys(model, keys)
    model.freeze()
    base_path = base_path or BasePath()
    replacements: list[tuple[nn.Module, str, nn.Module]] = []

    def visit(owner: nn.Module, name: str, module: nn.Module) -> None:
        if fine_tune_type == "full":
            if "scales" in module:  # a quantized layer's weight is packed words, not trainable values
                raise ValueError(full_needs_dense(f"layer {name} ({type(module).__name__})"))
            module.unfreeze()
        else:
            replacements.append((owner, name, _to_adapter(module, fine_tune_type, rank, scale, dropout, base_path)))

    count = _target_modules(model, num_layers, keys, visit)
    if fine_tune_type == "full" and keys is None:  # as mlx_lm.lora: the chosen blocks whole, norms included
        for block in chosen_blocks(model, num_layers):
            for name, module in block.named_modules():
                if "scales" in module:  # packed words of a type visit() does not meet (an MLA's MultiLinear)
                    raise ValueError(full_needs_dense(f"layer {name} ({type(module).__name__})"))
            block.unfreeze()
    for owner, name, new in replacements:
        owner.update_modules(tree_unflatten([(name, new)]))
    if count == 0:
        raise ValueError(f"no layers matched adapter.keys={keys} in the last {num_layers} blocks; "
                         "name modules relative to a block, e.g. --adapter.keys '[self_attn.q_proj]'")
    route_frozen_quantized(model, base_path)
    if not lazy:
        settle_norms(model)
    return count


def trainable_parameters(model: nn.Module) -> dict[str, mx.array]:
    """Flat name -> array of what training changes (what adapters.safetensors holds)."""
    return dict(tree_flatten(model.trainable_parameters()))


def mlx_lm_adapter_config(adapter: Any, *, model_path: str, data_path: str,
                          extra: dict[str, Any] | None = None,
                          model: nn.Module | None = None) -> dict[str, Any]:
    """adapter_config.json as stock mlx-lm reads it, plus the base model and data folder.

    Given the adapted `model`, it also records whether stock mlx-lm can load the
    adapters (`loadable_by_mlx_lm`) and, when not, which layers only meshtune rebuilds
    (`meshtune_layers`: path -> class); `load_adapters` checks those on the way in.
    """
    lora: dict[str, Any] = {"rank": adapter.rank, "scale": adapter.scale, "dropout": adapter.dropout}
    if adapter.keys is not None:
        lora["keys"] = list(adapter.keys)
    num_layers = adapter.num_layers
    if model is not None and num_layers > 0:  # more than the model has trains all: record how many
        num_layers = len(chosen_blocks(model, num_layers))
    config = {
        "fine_tune_type": adapter.fine_tune_type,
        "num_layers": num_layers,
        "lora_parameters": lora,
        "model": model_path,
        "data": data_path,
    }
    if model is not None:
        only_ours = stock_unloadable(model)
        config["loadable_by_mlx_lm"] = not only_ours
        if only_ours:
            config["meshtune_layers"] = only_ours
    config.update(extra or {})
    return config


def load_adapters(model: nn.Module, adapter_path: str | Path, model_path: str | None = None) -> nn.Module:
    """Apply the adapters described by adapter_path/adapter_config.json and load their weights; a mismatch
    names the base they were trained on where that is not `model_path` (the base loaded)."""
    folder = Path(adapter_path)
    config_file = RunDir(folder).config
    if not config_file.exists():
        if CheckpointDir(folder).stage_manifests():  # a pipeline's checkpoint: one shard per stage
            raise ValueError(f"{folder} is a pipeline checkpoint (one weights file per stage), which resumes but "
                             f"does not load as adapters; point --adapter-path at the run ({folder.parent.parent})")
        raise ValueError(f"{config_file} not found; point --adapter-path at a folder written by "
                         "meshtune train or mlx_lm.lora")
    config = json.loads(config_file.read_text())
    lora = config.get("lora_parameters") or {}
    keys = lora.get("keys")
    if keys:  # as stock mlx-lm loads: a key that names no module of this model adapted nothing
        in_block, in_model = _module_names(model)
        keys = [k for k in keys if k in in_block | in_model] or keys
    apply_adapters(model, fine_tune_type=config.get("fine_tune_type", "lora"),
                   num_layers=config["num_layers"], keys=keys,
                   rank=lora.get("rank", 8), scale=lora.get("scale", 20.0),
                   dropout=lora.get("dropout", 0.0))
    built = {name: type(m).__name__ for name, m in model.named_modules()}
    wrong = [f"{k} ({v})" for k, v in (config.get("meshtune_layers") or {}).items() if built.get(k) != v]
    if wrong:
        raise ValueError(f"{config_file} lists layers this model did not rebuild: {', '.join(wrong[:5])}; "
                         "load it on the model it was trained on")
    try:
        load_trainable(model, RunDir(folder).adapters, every=config.get("fine_tune_type") != "full")
    except ValueError as err:
        trained_on = config.get("model")
        if trained_on and model_path is not None and not same_source("model.path", model_path, trained_on):
            raise ValueError(f"{err}; these adapters were trained on {trained_on}: give --model "
                             f"{trained_on} or drop --model") from None
        raise
    return model


def load_trainable(model: nn.Module, weights_file: Path, weights: dict[str, mx.array] | None = None,
                   every: bool = True) -> None:
    """Load saved trainable weights (from the file, or `weights` read from it), naming every tensor that does
    not fit; with `every` false a trainable tensor the file lacks keeps the base's value (a full fine-tuning
    file, as stock mlx-lm loads it: one that trained no norms)."""
    if weights is None and not weights_file.exists():
        raise ValueError(f"{weights_file} not found; train first or point at the right folder")
    weights = mx.load(str(weights_file)) if weights is None else weights
    expected = trainable_parameters(model)
    problems = [f"{k}: not a trainable parameter of this model" for k in weights if k not in expected]
    problems += [f"{k}: shape {tuple(w.shape)} != {tuple(expected[k].shape)}"
                 for k, w in weights.items() if k in expected and w.shape != expected[k].shape]
    problems += [f"{k}: missing from the file" for k in expected if k not in weights and every]
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
