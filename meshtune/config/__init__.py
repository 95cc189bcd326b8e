"""The run configuration: one typed, strict tree of sections (schema), how a file, a dict or flags become
one (load), what each field accepts and its help (fields), and mlx-lm's flat keys read as ours (mlx_lm_compat)."""

from .schema import *  # noqa: F401,F403
from .schema import __all__ as _schema_names
from .schema import ASSETS, DEFAULT_DATA_PATH, DEFAULT_MODEL_PATH  # noqa: F401
