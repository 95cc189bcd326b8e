"""Adapters: the LoRA layer family (DoRA its variant), how it is applied, saved, loaded and fused,
and `step_context`, the per-step hook a training step runs inside (per_step.py)."""

from ..run_dir import ADAPTER_FILE, CONFIG_FILE  # the run folder's names, re-exported from their owner
from .apply import (apply_adapters, fuse_adapters, load_adapters, load_trainable, mlx_lm_adapter_config,
                    stock_unloadable, trainable_parameters)
from .base_path import get_base_path, measure_crossover, set_base_path
from .dora import DoRAEmbedding, DoRALinear, DoRASwitchLinear, settle_norms
from .lora import LoRAEmbedding, LoRALinear
from .per_step import PerStepWork, step_context
from .switch import LoRASwitchLinear

__all__ = ["ADAPTER_FILE", "CONFIG_FILE", "DoRAEmbedding", "DoRALinear", "DoRASwitchLinear",
           "LoRAEmbedding", "LoRALinear", "LoRASwitchLinear", "PerStepWork", "apply_adapters", "fuse_adapters",
           "get_base_path", "load_adapters", "load_trainable", "measure_crossover",
           "mlx_lm_adapter_config", "set_base_path", "settle_norms", "step_context", "stock_unloadable",
           "trainable_parameters"]
