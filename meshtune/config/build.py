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
from dataclasses import dataclass, field
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


@dataclass
class _Collected:
    """What build gathers on its way: each setting with where it was set, and every problem, note and
    mlx-lm key it mapped."""

    source: str
    lines: dict[str, int]
    problems: list[str]
    mapped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    settings: dict[str, _Setting] = field(default_factory=dict)

    def loc(self, path: str) -> str:
        return f"{self.source}:{self.lines[path]}" if path in self.lines else self.source

    def put(self, target: str, value: Any, spelled: str) -> None:
        old = self.settings.get(target)
        if old is not None and not old.override:
            self.problems.append(f"{self.loc(spelled)}: {target} is given twice, as {spelled} "
                                 f"and as {old.spelled} ({old.where}); keep only one")
        elif old is None:
            self.settings[target] = _Setting(value, self.loc(spelled), spelled)

    def take(self, result: Any) -> None:
        """An mlx-lm mapping's result: its assignments, and what it mapped, noted and found wrong."""
        for target, v, spelled in result.assignments:
            self.put(target, v, spelled)
        self.mapped += result.mapped
        self.notes += result.notes
        self.problems += result.problems

    def read(self, key: Any, value: Any) -> None:
        """One top-level key of the file: a section, a flat mlx-lm key, or a problem."""
        if not isinstance(key, str):
            self.problems.append(f"{self.loc(str(key))}: key {key!r} is not a name; quote it or fix the typo")
        elif key in SECTIONS and isinstance(value, dict):
            for sub, v in value.items():
                dotted = f"{key}.{sub}"
                if isinstance(sub, str) and sub in field_types(key):
                    self.put(dotted, v, dotted)
                else:
                    self.problems.append(f"{self.loc(dotted)}: unknown key '{dotted}'{suggest_key(dotted)}")
        elif key in SECTIONS and value is None:
            return  # an empty section
        elif compat.is_flat(key):
            self.take(compat.map_flat(key, value, self.loc))
        elif key in SECTIONS:
            self.problems.append(f"{self.loc(key)}: section '{key}' must be a mapping of keys "
                                 f"({', '.join(field_types(key))}), got {type(value).__name__}")
        else:
            close = difflib.get_close_matches(key, [*SECTIONS, *compat.flat_names()], n=1)
            if close and close[0] in compat.FLAT_KEYS:
                hint = f"; did you mean '{close[0]}' (mlx-lm spelling of {compat.FLAT_KEYS[close[0]]})?"
            elif close:
                hint = f"; did you mean '{close[0]}'?"
            else:
                hint = f"; sections are {', '.join(SECTIONS)}"
            self.problems.append(f"{self.loc(key)}: unknown key '{key}'{hint}")

    def rate_from_schedule(self) -> None:
        """mlx-lm takes the rate from the schedule's first argument; keep that when no rate is given."""
        args = self.settings.get("schedule.arguments")
        if (args is not None and "optimizer.learning_rate" not in self.settings and isinstance(args.value, list)
                and args.value and isinstance(args.value[0], (int, float)) and not isinstance(args.value[0], bool)):
            self.settings["optimizer.learning_rate"] = _Setting(args.value[0], args.where, f"{args.spelled}[0]")
            self.notes.append(f"optimizer.learning_rate = {args.value[0]} taken from {args.spelled}[0]")

    def typed(self) -> dict[str, dict[str, Any]]:
        """Section -> key -> value of its field's type; a value that cannot be one is a problem."""
        values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
        for target, s in self.settings.items():
            section, _, key = target.partition(".")
            ok, value, why = coerce(s.value, field_types(section)[key])
            if ok:
                values[section][key] = value
            else:
                shown = s.spelled if s.spelled.lstrip("-") == target else f"{s.spelled} (-> {target})"
                self.problems.append(f"{s.where}: {shown} = {describe_value(s.value)}: {why}")
        return values


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
    got = _Collected(source, lines or {}, list(problems))
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections "
                          f"({', '.join(SECTIONS)}), got {type(raw).__name__}")

    # Overrides go in first and win over anything the file says.
    for target, value, spelled in overrides:
        got.settings[target] = _Setting(value, override_source, spelled, override=True)

    optimizer_config = None
    for key, value in raw.items():
        if key == "optimizer_config":  # read once the optimizer's name is known
            optimizer_config = value
        else:
            got.read(key, value)
    name = got.settings["optimizer.name"].value if "optimizer.name" in got.settings else "adam"
    got.take(compat.map_optimizer_config(optimizer_config, name, list(OPTIMIZER_OPTIONS), got.loc))
    got.rate_from_schedule()
    values = got.typed()
    if got.problems:
        raise ConfigError(got.problems)
    # "<dict>"-style sources say nothing a message could use.
    origins = {t: s.where for t, s in got.settings.items() if not s.where.startswith("<")}
    return Built({s: SECTIONS[s](**values[s]) for s in SECTIONS}, got.mapped, got.notes, origins)
