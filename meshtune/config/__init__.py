"""The run configuration: one typed, strict tree of sections.

The modules import one way: sections (the dataclasses, ConfigError) <- fields (what
each field accepts, its help) <- build (plain data to checked sections) <- schema
(Config and its cross-field rules) <- load (YAML files and command-line overrides);
mlx_lm_compat reads mlx-lm's flat keys as ours. Import from here.
"""

from .fields import describe_options, field_help
from .load import apply_overrides, load_config, parse_override_args
from .mlx_lm_compat import MLX_LM_FLAGS, MLX_LM_SWITCHES
from .schema import Config
from .sections import (
    ASSETS, DEFAULT_DATA_PATH, DEFAULT_MODEL_PATH, OPTIMIZER_OPTIONS, SECTIONS, AdapterConfig, ConfigError,
    DataConfig, ModelConfig, OptimizerConfig, OutputConfig, ParallelConfig, RuntimeConfig, ScheduleConfig,
    TrainConfig,
)

__all__ = [
    "ASSETS", "AdapterConfig", "Config", "ConfigError", "DEFAULT_DATA_PATH", "DEFAULT_MODEL_PATH", "DataConfig",
    "MLX_LM_FLAGS", "MLX_LM_SWITCHES", "ModelConfig", "OPTIMIZER_OPTIONS", "OptimizerConfig", "OutputConfig",
    "ParallelConfig", "RuntimeConfig", "SECTIONS", "ScheduleConfig", "TrainConfig", "apply_overrides",
    "describe_options", "field_help", "load_config", "parse_override_args",
]
