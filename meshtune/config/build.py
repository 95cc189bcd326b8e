"""Building a configuration: a dict of sections and/or flat mlx-lm keys, checked, becomes section values.

:func:`build` is the one strict path from plain data to typed sections: every key
is checked against the schema (with the nearest valid one suggested), mlx-lm's flat
keys are mapped (:mod:`meshtune.config.mlx_lm_compat`), overrides win over the file,
and all problems are collected into one ConfigError whose lines name the file and
line (or option), the value and the fix. :class:`~meshtune.config.schema.Config`
wraps the result; the YAML and command-line side is :mod:`meshtune.config.load`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Sequence

from . import mlx_lm_compat as compat
from .fields import coerce, describe_value, field_types, suggest_key
from .sections import OPTIMIZER_OPTIONS, SECTIONS, ConfigError


@dataclass
class Built:
    """A checked configuration: one instance per section, and what the loader did on the way."""

    sections: dict[str, Any]
    """Section name -> its dataclass instance (model -> ModelConfig, ...)."""
    mapped: list[str]
    """mlx-lm keys read as meshtune ones, e.g. "learning_rate -> optimizer.learning_rate"."""
    notes: list[str]
    """Things the user should hear about (ignored keys, derived values)."""
    origins: dict[str, str]
    """Dotted key -> where its value was set ("run.yaml:7", "command line")."""


@dataclass
class _Setting:
    value: Any
    where: str
    spelled: str
    override: bool = False


def build(
    raw: Any,
    source: str,
    lines: dict[str, int] | None = None,
    overrides: Sequence[tuple[str, Any, str]] = (),
    problems: Sequence[str] = (),
    override_source: str = "command line",
) -> Built:
    """Check `raw` (sections and/or flat mlx-lm keys) with `overrides` on top; strict.

    `lines` maps dotted keys to their line in `source`, `overrides` are resolved
    (dotted key, value, as spelled) items that win over `raw`, and `problems` are
    ones found earlier (e.g. duplicate YAML keys). Every problem, old and new, is
    raised as one ConfigError.
    """
    lines = lines or {}
    problems = list(problems)
    mapped: list[str] = []
    notes: list[str] = []
    settings: dict[str, _Setting] = {}

    def loc(path: str) -> str:
        return f"{source}:{lines[path]}" if path in lines else source

    def put(target: str, value: Any, spelled: str) -> None:
        old = settings.get(target)
        if old is not None and not old.override:
            problems.append(f"{loc(spelled)}: {target} is given twice, as {spelled} "
                            f"and as {old.spelled} ({old.where}); keep only one")
        elif old is None:
            settings[target] = _Setting(value, loc(spelled), spelled)

    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections "
                          f"({', '.join(SECTIONS)}), got {type(raw).__name__}")

    # Overrides go in first and win over anything the file says.
    for target, value, spelled in overrides:
        settings[target] = _Setting(value, override_source, spelled, override=True)

    optimizer_config = None
    for key, value in raw.items():
        if not isinstance(key, str):
            problems.append(f"{loc(str(key))}: key {key!r} is not a name; quote it or fix the typo")
        elif key in SECTIONS and isinstance(value, dict):
            for sub, v in value.items():
                dotted = f"{key}.{sub}"
                if isinstance(sub, str) and sub in field_types(key):
                    put(dotted, v, dotted)
                else:
                    problems.append(f"{loc(dotted)}: unknown key '{dotted}'{suggest_key(dotted)}")
        elif key in SECTIONS and value is None:
            continue  # an empty section
        elif key == "optimizer_config":
            optimizer_config = value
        elif compat.is_flat(key):
            result = compat.map_flat(key, value, loc)
            for target, v, spelled in result.assignments:
                put(target, v, spelled)
            mapped += result.mapped
            notes += result.notes
            problems += result.problems
        elif key in SECTIONS:
            problems.append(f"{loc(key)}: section '{key}' must be a mapping of keys "
                            f"({', '.join(field_types(key))}), got {type(value).__name__}")
        else:
            close = difflib.get_close_matches(key, [*SECTIONS, *compat.flat_names()], n=1)
            if close and close[0] in compat.FLAT_KEYS:
                hint = f"; did you mean '{close[0]}' (mlx-lm spelling of {compat.FLAT_KEYS[close[0]]})?"
            elif close:
                hint = f"; did you mean '{close[0]}'?"
            else:
                hint = f"; sections are {', '.join(SECTIONS)}"
            problems.append(f"{loc(key)}: unknown key '{key}'{hint}")

    name = settings["optimizer.name"].value if "optimizer.name" in settings else "adam"
    result = compat.map_optimizer_config(optimizer_config, name, list(OPTIMIZER_OPTIONS), loc)
    for target, v, spelled in result.assignments:
        put(target, v, spelled)
    mapped += result.mapped
    notes += result.notes
    problems += result.problems

    # mlx-lm takes the rate from the schedule's first argument; keep that when no rate is given.
    args = settings.get("schedule.arguments")
    if (args is not None and "optimizer.learning_rate" not in settings and isinstance(args.value, list)
            and args.value and isinstance(args.value[0], (int, float)) and not isinstance(args.value[0], bool)):
        settings["optimizer.learning_rate"] = _Setting(args.value[0], args.where, f"{args.spelled}[0]")
        notes.append(f"optimizer.learning_rate = {args.value[0]} taken from {args.spelled}[0]")

    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for target, s in settings.items():
        section, _, key = target.partition(".")
        ok, value, why = coerce(s.value, field_types(section)[key])
        if ok:
            values[section][key] = value
        else:
            shown = s.spelled if s.spelled.lstrip("-") == target else f"{s.spelled} (-> {target})"
            problems.append(f"{s.where}: {shown} = {describe_value(s.value)}: {why}")
    if problems:
        raise ConfigError(problems)
    # "<dict>"-style sources say nothing a message could use.
    origins = {t: s.where for t, s in settings.items() if not s.where.startswith("<")}
    return Built({s: SECTIONS[s](**values[s]) for s in SECTIONS}, mapped, notes, origins)
