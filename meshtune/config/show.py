"""Showing the configuration: every option for `--help`, and a resolved config as YAML.

:func:`options_help` is the text under `meshtune train --help`: each section a
heading, each key one line (`--section.key TYPE (default X)  doc`, the doc being the
first sentence of the field's docstring), then the mlx_lm.lora flags that mean the
same keys. :func:`config_yaml` writes a :class:`~meshtune.config.schema.Config` as the
YAML `-c` reads back into an equal config (`meshtune config` prints it).
"""

from __future__ import annotations

import re
import textwrap
import types
import typing
from typing import Any, Literal

import yaml

from .fields import field_types, describe_options
from .mlx_lm_compat import MLX_LM_FLAGS, MLX_LM_SWITCHES
from .schema import Config
from .sections import SECTIONS


def _type_word(tp: Any) -> str:
    """A short TYPE for the help line: INT, FLOAT, BOOL, STR, {a,b}, [STR,...], MAPPING, X|null."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "{" + ",".join(str(a) for a in args) + "}"
    if origin in (typing.Union, types.UnionType):
        return "|".join("null" if a is type(None) else _type_word(a) for a in args)
    if origin is list:
        return f"[{_type_word(args[0])},...]"
    if origin is dict or tp is dict:
        return "MAPPING"
    return getattr(tp, "__name__", str(tp)).upper()


def _value_text(value: Any) -> str:
    """A default as it is written on the command line or in YAML (flow style)."""
    if value == "":
        return '""'
    if isinstance(value, float):
        return repr(value)  # 1e-05, not YAML's 1.0e-05
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def _first_sentence(doc: str) -> str:
    """The docstring's first sentence, whole ("e.g. [a, b]" does not end one)."""
    return " ".join(re.split(r"\.\s+(?=[A-Z])", doc, maxsplit=1)[0].rstrip(".").split())


def options_help() -> str:
    """Every config key by section (type, default, one-line doc), then the mlx_lm.lora flags."""
    rows = {dotted: (default, doc) for dotted, _, default, doc in describe_options()}
    lines = ["config keys: give any as --section.key VALUE (VALUE is read as YAML: 1e-5, true, [a, b], null)",
             "or put it under its section in a -c YAML file; `meshtune config` prints the resolved config.", ""]
    for section, cls in SECTIONS.items():
        lines.append(f"{section}: {(cls.__doc__ or '').strip()}")
        for key, tp in field_types(section).items():
            default, doc = rows[f"{section}.{key}"]
            lines.append(f"  --{section}.{key} {_type_word(tp)} (default {_value_text(default)})")
            lines += textwrap.wrap(_first_sentence(doc), width=100, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6)
        lines.append("")
    lines.append("mlx_lm.lora flags (each sets the config key beside it; * takes no value):")
    flags = [f"{flag}{'*' if flag in MLX_LM_SWITCHES else ''} -> {key}" for flag, key in MLX_LM_FLAGS.items()]
    width = max(len(f) for f in flags) + 2
    for i in range(0, len(flags), 2):
        lines.append("  " + "".join(f.ljust(width) for f in flags[i:i + 2]).rstrip())
    return "\n".join(lines)


def config_yaml(cfg: Config) -> str:
    """The config's every key as YAML, by section; `-c` of it gives an equal config and the same YAML."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False, width=1000)
