"""The bench suites' argument parser and types: a flag no run can take is one line naming it, before
anything runs (`--steps 0` was a division by zero minutes in)."""

from __future__ import annotations

import argparse
import re
from typing import Callable


class BenchParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (`meshtune: error: --steps 0: must be at least 1`,
    exit 2, as every meshtune error) instead of the usage block and the message. Descriptions keep their
    own line breaks (a suite's HELP is laid out as written)."""

    def __init__(self, *args, formatter_class: type = argparse.RawDescriptionHelpFormatter, **kwargs) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        m = re.fullmatch(r"argument ([^:]+): (.*)", message, flags=re.S)
        if m:
            flag = m.group(1).split("/")[-1]
            value, sep, why = m.group(2).partition(": ")
            # at_least's "0: must be at least 1" reads as "--steps 0: must be at least 1"
            message = f"{flag} {value}: {why}" if sep and " " not in value else f"{flag}: {m.group(2)}"
        raise ValueError(f"{message} ({self.prog} --help lists its flags)")


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer of at least `minimum` (`--steps 0` is an error, not a division by zero later)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text}: not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be at least {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def positive_float(text: str) -> float:
    """A number above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: must be above 0")
    return value


COUNT = at_least(1)  # steps, rounds, batch sizes, ranks of an adapter: at least one
