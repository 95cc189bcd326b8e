"""Adapters: the LoRA layer family and how it is applied, saved, loaded and fused."""

from .apply import (ADAPTER_FILE, CONFIG_FILE, apply_adapters, fuse_adapters, load_adapters,
                    load_trainable, mlx_lm_adapter_config, trainable_parameters)
from .lora import LoRAEmbedding, LoRALinear

__all__ = ["ADAPTER_FILE", "CONFIG_FILE", "LoRAEmbedding", "LoRALinear", "apply_adapters",
           "fuse_adapters", "load_adapters", "load_trainable", "mlx_lm_adapter_config",
           "trainable_parameters"]
