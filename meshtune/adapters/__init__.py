"""Adapters: the LoRA layer family (DoRA its variant), how it is applied, saved, loaded and fused,
`BasePath` (how quantized bases multiply) and `StepContext`, the per-step hook a training step runs
inside (per_step.py)."""

from ..run_dir import ADAPTER_FILE, CONFIG_FILE  # the run folder's names, re-exported from their owner
from .apply import (apply_adapters, fuse_adapters, load_adapters, load_trainable, mlx_lm_adapter_config,
                    stock_unloadable, trainable_parameters)
from .base_path import BasePath, measure_crossover
from .dora import DoRAEmbedding, DoRALinear, DoRASwitchLinear, settle_norms
from .lora import LoRAEmbedding, LoRALinear
from .per_step import PerStepWork, StepContext
from .switch import LoRASwitchLinear

__all__ = ["ADAPTER_FILE", "BasePath", "CONFIG_FILE", "DoRAEmbedding", "DoRALinear", "DoRASwitchLinear",
           "LoRAEmbedding", "LoRALinear", "LoRASwitchLinear", "PerStepWork", "StepContext", "apply_adapters",
           "fuse_adapters", "load_adapters", "load_trainable", "measure_crossover", "mlx_lm_adapter_config",
           "settle_norms", "stock_unloadable", "trainable_parameters"]
