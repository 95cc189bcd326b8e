"""Reading configs: YAML with line numbers, ``--section.key value`` overrides, load_config.

This module turns YAML text, dicts and command-line overrides into a
:class:`~meshtune.config.schema.Config` through :func:`meshtune.config.build.build`,
which collects every problem into one ConfigError whose lines name the file and
line (or option), the value and the fix. Cross-field rules are :meth:`Config.validate`'s.
"""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any

import yaml

from . import mlx_lm_compat as compat
from .build import build
from .fields import _all_keys, coerce, describe_value, field_types, suggest_key
from .mlx_lm_compat import MLX_LM_FLAGS, MLX_LM_SWITCHES
from .schema import Config
from .sections import SECTIONS, ConfigError


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads 1e-5, 1E5 and -3e+2 as floats, as mlx-lm does.

    A subclass, so yaml.SafeLoader itself stays untouched.
    """


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _yaml_error(e: yaml.YAMLError, name: str) -> ConfigError:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{name}:{mark.line + 1}" if mark is not None else name
    problem = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    return ConfigError(f"{where}: YAML syntax error: {problem}{f' ({context})' if context else ''}; fix the YAML there")


def _read_yaml(text: str, name: str) -> tuple[Any, dict[str, int], list[str]]:
    """(data, dotted key -> line, duplicate-key problems)."""
    loader = _YamlLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        raise _yaml_error(e, name) from None
    finally:
        loader.dispose()
    lines: dict[str, int] = {}
    problems: list[str] = []

    def walk(n: yaml.Node, prefix: str) -> None:
        if not isinstance(n, yaml.MappingNode):
            return
        for key_node, value_node in n.value:
            path = f"{prefix}{key_node.value}" if isinstance(key_node, yaml.ScalarNode) else f"{prefix}?"
            line = key_node.start_mark.line + 1
            if path in lines:
                problems.append(f"{name}:{line}: duplicate key '{path}' (first at line {lines[path]}); keep one")
                continue
            lines[path] = line
            walk(value_node, path + ".")

    if node is not None:
        walk(node, "")
    return data, lines, problems


def _parse_scalar(text: str, tp: Any) -> Any:
    # A plain string option keeps its text: "--model.path 2024" or "--output.adapter_path yes" mean paths.
    if tp is str and text[:1] not in ("'", '"'):
        return text
    loader = _YamlLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _resolve_overrides(
    items: list[tuple[str, Any]], source: str, parse: bool
) -> tuple[list[tuple[str, Any, str]], list[str]]:
    """Check override keys (and parse string values); ([(dotted, value, key)], problems)."""
    resolved, problems = [], []
    for raw_key, value in items:
        # mlx_lm.lora's own flags (--learning-rate, ...) mean the same as our keys.
        key = MLX_LM_FLAGS.get(str(raw_key), str(raw_key)).removeprefix("--")
        section, _, name = key.partition(".")
        dotted = f"{section}.{name.replace('-', '_')}"
        if section not in SECTIONS or dotted.partition(".")[2] not in field_types(section):
            problems.append(f"{source}: unknown option --{key}{_unknown_hint(key)}")
            continue
        tp = field_types(section)[dotted.partition(".")[2]]
        if parse and isinstance(value, str):
            try:
                value = _parse_scalar(value, tp)
            except yaml.YAMLError as e:
                problems.append(f"{source}: --{dotted} {value!r}: cannot parse the value "
                                f"({getattr(e, 'problem', e)}); quote it for the shell, e.g. '[a, b]'")
                continue
        resolved.append((dotted, value, f"--{dotted}"))
    return resolved, problems


def _known_option(token: str) -> bool:
    key = MLX_LM_FLAGS.get(token, token).removeprefix("--")
    section, _, name = key.partition(".")
    return section in SECTIONS and name.replace("-", "_") in field_types(section)


def _unknown_hint(key: str) -> str:
    """'; did you mean ...?' for an unknown option `--key`: the mlx-lm flag and/or the config key."""
    flat = compat.FLAT_KEYS.get(key.replace("-", "_"))
    if flat:
        flag = next((f for f, target in MLX_LM_FLAGS.items() if target == flat), None)
        return f"; did you mean {flag} (--{flat})?" if flag else f"; did you mean --{flat}?"
    flat_name = key.replace("-", "_")
    if flat_name == "train":
        return "; mlx_lm.lora's --train is not needed: meshtune train always trains, so drop it"
    if flat_name in compat.IGNORED:
        return f"; {compat.IGNORED[flat_name]}, so drop it"
    if flat_name in compat.NESTED_KEYS:  # mlx-lm's mapping keys: their entries are meshtune options
        entries = ", ".join(f"--{k}" for k in compat.NESTED_KEYS[flat_name].values())
        return f"; mlx-lm's {flat_name} is a YAML mapping; here its entries are options: {entries}"
    if "." not in key:  # spelled like an mlx_lm.lora flag
        close = difflib.get_close_matches(f"--{key}", list(MLX_LM_FLAGS), n=1, cutoff=0.75)
        if close:
            return f"; did you mean {close[0]} (--{MLX_LM_FLAGS[close[0]]})?"
        dotted = difflib.get_close_matches(key.replace("-", "_"), [k.partition(".")[2] for k in _all_keys()], n=1)
        if dotted:
            section = next(s for s in SECTIONS if dotted[0] in field_types(s))
            return f"; did you mean --{section}.{dotted[0]}?"
        return "; see meshtune train --help for every option"
    section, _, name = key.partition(".")
    return suggest_key(f"{section}.{name.replace('-', '_')}", "--").replace("'", "")


def parse_override_args(tokens: list[str]) -> list[tuple[str, str]]:
    """Split ``["--train.iters", "10", "--train.compile=false"]`` into (key, text) pairs.

    A bool option given without a value means true.
    """
    items, problems = _split_override_args(tokens)
    if problems:
        raise ConfigError(problems)
    return items


def _split_override_args(tokens: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    items: list[tuple[str, str]] = []
    problems: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            problems.append(f"command line: unexpected argument {token!r}; options look like --section.key value")
            i += 1
            continue
        if "=" in token:
            key, _, text = token.partition("=")
            items.append((key, text))
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            items.append((token, tokens[i + 1]))
            i += 2
        else:
            section, _, name = token[2:].partition(".")
            is_switch = token in MLX_LM_SWITCHES or (
                section in SECTIONS and field_types(section).get(name.replace("-", "_")) is bool)
            if is_switch:
                items.append((token, "true"))
            elif _known_option(token):
                problems.append(f"command line: option {token} needs a value, e.g. {token} VALUE")
            else:
                problems.append(f"command line: unknown option {token}{_unknown_hint(token[2:])}")
            i += 1
    return items, problems


def flag_spellings(items: list[tuple[str, str]]) -> dict[str, str]:
    """Dotted key -> the flag as the user typed it, for (key, text) pairs of parse_override_args.

    ``[("--learning-rate", "1e-3")]`` gives ``{"optimizer.learning_rate": "--learning-rate"}``,
    so a message can name the flag the user knows; unknown keys are left out.
    """
    spelled = {}
    for raw_key, _ in items:
        key = MLX_LM_FLAGS.get(str(raw_key), str(raw_key)).removeprefix("--")
        section, _, name = key.partition(".")
        if str(raw_key).startswith("--") and section in SECTIONS and name.replace("-", "_") in field_types(section):
            spelled[f"{section}.{name.replace('-', '_')}"] = str(raw_key)
    return spelled


def apply_overrides(
    cfg_dict: dict[str, Any], items: list[tuple[str, str]], source: str = "command line"
) -> dict[str, Any]:
    """Return a copy of ``cfg_dict`` with ``--section.key value`` items set.

    Values are read with the config's YAML scalar rules (``1e-5`` is a float,
    ``[a, b]`` a list, ``false`` a bool); text given for a str option stays
    as written.  Unknown keys and wrong types raise one ConfigError.  An
    mlx-lm spelling of the same option in ``cfg_dict`` is dropped: the
    override wins.
    """
    resolved, problems = _resolve_overrides(items, source, parse=True)
    out = copy.deepcopy(cfg_dict) if cfg_dict else {}
    for target, value, spelled in resolved:
        section, _, key = target.partition(".")
        ok, value, why = coerce(value, field_types(section)[key])
        if not ok:
            problems.append(f"{source}: {spelled} = {describe_value(value)}: {why}")
            continue
        for flat, sub in compat.aliases_of(target):
            if sub is None and flat in out and not isinstance(out[flat], dict):
                del out[flat]
            elif sub is not None and isinstance(out.get(flat), dict):
                out[flat].pop(sub, None)
        if not isinstance(out.get(section), dict):
            out[section] = {}
        out[section][key] = value
    if problems:
        raise ConfigError(problems)
    return out


def load_config(
    path: str | Path | None,
    overrides: list[str] | list[tuple[str, str]] | dict[str, Any] | None = None,
) -> Config:
    """Read a YAML config (None: defaults), apply overrides, check keys and types.

    ``overrides`` is command-line text, either as tokens
    (``["--train.iters", "10"]``) or as (key, text) pairs
    (``[("train.iters", "10")]``), values parsed as YAML scalars; or a dict
    of typed values, keyed by dotted name or nested by section.  Cross-field rules are left to
    :meth:`Config.validate`, which needs the world size.
    """
    raw: Any = {}
    lines: dict[str, int] = {}
    problems: list[str] = []
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"{source}: cannot read the config file ({e.strerror or e}); check the path") from None
        raw, lines, problems = _read_yaml(text, source)
        if raw is None and not problems:  # else a run of defaults, as if the file named none of its settings
            raise ConfigError(f"{source}: the config file is empty (no settings); write its settings into it, "
                              "or drop -c to run on the command line's flags alone")
        if isinstance(raw, dict) and isinstance(raw.get("meshtune"), dict) and "fine_tune_type" in raw:
            # A run's adapter_config.json: its "meshtune" entry is the run's whole resolved config,
            # less where and how that run was launched (its folder, layout and runtime: this launch's).
            raw, lines = {s: dict(v) for s, v in raw["meshtune"].items()
                          if isinstance(v, dict) and s not in ("parallel", "runtime")}, {}
            for key in ("adapter_path", "resume", "overwrite"):
                raw.get("output", {}).pop(key, None)
    if overrides is None:
        resolved: list[tuple[str, Any, str]] = []
    elif isinstance(overrides, dict):
        flat_items: list[tuple[str, Any]] = []
        for key, value in overrides.items():
            if key in SECTIONS and isinstance(value, dict):
                flat_items += [(f"{key}.{k}", v) for k, v in value.items()]
            else:
                flat_items.append((key, value))
        resolved, more = _resolve_overrides(flat_items, "overrides", parse=False)
        problems += more
    else:
        pairs = [o for o in overrides if isinstance(o, tuple)]
        items, more = _split_override_args([o for o in overrides if not isinstance(o, tuple)])
        items = pairs + items
        resolved, even_more = _resolve_overrides(items, "command line", parse=True)
        problems += more + even_more
    return Config.from_built(build(raw, source, lines, resolved, problems,
                                   "overrides" if isinstance(overrides, dict) else "command line"))
