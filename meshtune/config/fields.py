"""Config field types: what each option accepts, its help text, and the nearest valid key.

The sections' dataclass annotations become type checks and coercions (YAML and
command-line text both pass through `coerce`), field docstrings become help text,
and a misspelled key gets the closest real one.
"""

from __future__ import annotations

import ast
import copy
import difflib
import functools
import inspect
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

from .sections import SECTIONS, ConfigError


@functools.lru_cache(maxsize=None)
def field_types(section: str) -> dict[str, Any]:
    return typing.get_type_hints(SECTIONS[section])


@functools.lru_cache(maxsize=None)
def _all_help() -> dict[tuple[str, str], str]:
    # Field docstrings are string statements after the field; only the source has them.
    try:
        files = {inspect.getsourcefile(cls) for cls in SECTIONS.values()}
        trees = [ast.parse(Path(f).read_text(encoding="utf-8")) for f in sorted(files)]
    except (OSError, TypeError):
        return {}
    classes = {cls.__name__: name for name, cls in SECTIONS.items()}
    found: dict[tuple[str, str], str] = {}
    for node in (n for tree in trees for n in tree.body):
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for stmt, after in zip(node.body, node.body[1:]):
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                        and isinstance(after.value.value, str)):
                    found[(classes[node.name], stmt.target.id)] = " ".join(after.value.value.split())
    return found


def _all_keys() -> list[str]:
    return [f"{s}.{k}" for s in SECTIONS for k in field_types(s)]


def field_help(section: str, key: str) -> str:
    """The help text of ``section.key``, taken from its docstring."""
    if section not in SECTIONS or key not in field_types(section):
        dotted = f"{section}.{key}"
        raise ConfigError(f"unknown option '{dotted}'{_did_you_mean(dotted, _all_keys())}")
    return _all_help().get((section, key), "")


def describe_options() -> list[tuple[str, str, Any, str]]:
    """(dotted key, type name, default, help) for every option, for --help output."""
    rows = []
    for section, cls in SECTIONS.items():
        default = cls()
        for key, tp in field_types(section).items():
            rows.append((f"{section}.{key}", _type_name(tp), getattr(default, key), field_help(section, key)))
    return rows


def _did_you_mean(name: str, candidates: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"; did you mean '{prefix}{close[0]}'?" if close else ""


def suggest_key(dotted: str, prefix: str = "") -> str:
    """'; did you mean ...?' for an unknown dotted key, or the valid keys."""
    section, _, key = dotted.partition(".")
    if section in SECTIONS:
        same = difflib.get_close_matches(key, list(field_types(section)), n=1, cutoff=0.6)
        if same:
            return f"; did you mean '{prefix}{section}.{same[0]}'?"
        elsewhere = [s for s in SECTIONS if key in field_types(s)]
        if elsewhere:
            return f"; did you mean '{prefix}{elsewhere[0]}.{key}'?"
        return f"; valid keys in '{section}': {', '.join(field_types(section))}"
    return _did_you_mean(dotted, _all_keys(), prefix) or f"; sections are {', '.join(SECTIONS)}"


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any) -> tuple[bool, Any, str]:
    """(ok, value as stored, why not).  Ints pass as floats; nothing else converts."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return True, value, ""
        lowered = {str(a).lower(): a for a in args}
        hint = ""
        if isinstance(value, str):
            close = difflib.get_close_matches(value.lower(), list(lowered), n=1, cutoff=0.6)
            hint = f"; did you mean {lowered[close[0]]!r}?" if close else ""
        return False, value, f"expected {_type_name(tp)}{hint}"
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return True, None, ""
        results = [coerce(value, a) for a in args if a is not type(None)]
        good = [r for r in results if r[0]]
        if good:
            return good[0]
        # With one real alternative its own message says more (e.g. which list item is wrong).
        return results[0] if len(results) == 1 else (False, value, f"expected {_type_name(tp)}")
    if origin is list:
        if not isinstance(value, list):
            return False, value, f"expected {_type_name(tp)}, e.g. [a, b]"
        items = [coerce(v, args[0]) for v in value]
        failed = [i for i, r in enumerate(items) if not r[0]]
        if failed:
            i = failed[0]
            return False, value, f"expected {_type_name(tp)}; item {i} = {describe_value(value[i])}: {items[i][2]}"
        return True, [r[1] for r in items], ""
    if origin is dict or tp is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return True, copy.deepcopy(value), ""
        return False, value, "expected a mapping of names to values"
    if tp is Any:
        return True, value, ""
    if tp is bool:
        if isinstance(value, bool):
            return True, value, ""
        return False, value, "expected bool: write true or false"
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value, ""
        hint = f": write {int(value)}" if isinstance(value, float) and value.is_integer() else ""
        return False, value, f"expected int{hint}"
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return finite_float(float(value))
        return False, value, "expected float, e.g. 1e-5"
    if tp is str:
        if isinstance(value, str):
            return True, value, ""
        return False, value, "expected str: quote it"
    raise TypeError(f"unsupported config field type {tp!r}")


FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: a run's numbers are float32 on the device, so a larger setting is inf there."""


def finite_float(value: float) -> tuple[bool, float, str]:
    """(ok, value, why not) for a float setting: nan and inf, or a number float32 turns into inf, never are one."""
    if not math.isfinite(value):
        return False, value, "expected a finite number (nan and inf are never a setting), e.g. 1e-5"
    if abs(value) > FLOAT32_MAX:
        return False, value, "is inf in float32, which the run computes in; give a number below 3.4e38"
    return True, value, ""


def describe_value(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def type_problems(cfg: Any) -> list[str]:
    """Every field of `cfg` (anything with one attribute per section, e.g. a Config) its type does not accept."""
    problems = []
    for section in SECTIONS:
        obj = getattr(cfg, section)
        if not isinstance(obj, SECTIONS[section]):
            problems.append(f"{section}: expected a {SECTIONS[section].__name__}, got {type(obj).__name__}")
            continue
        for key, tp in field_types(section).items():
            ok, _, why = coerce(getattr(obj, key), tp)
            if not ok:
                problems.append(f"{section}.{key} = {describe_value(getattr(obj, key))}: {why}")
    return problems
