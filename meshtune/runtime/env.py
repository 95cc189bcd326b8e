"""Switches read from the environment (MESHTUNE_*): a value outside a switch's choices is a one-line error."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def choice(name: str, value: str, choices: dict[str, T], uses: str) -> T:
    """What `value`, given for the variable `name`, selects among `choices`; `uses` tells the user the choices."""
    if value not in choices:
        raise ValueError(f"{name}={value!r}: use {uses}")
    return choices[value]


def integer(name: str, value: str, uses: str) -> int:
    """`value`, given for the variable `name`, as a whole number; `uses` tells the user what it means."""
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: use {uses}") from None
