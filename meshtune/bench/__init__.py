"""Benchmarks that run their peer in the same invocation and print both.

SUITES maps each `meshtune bench` suite to the module whose main(argv) runs it. `meshtune bench
--help` lists the suites with the first line of each module's docstring, and `meshtune bench SUITE
--help` says what that suite measures and how; docs/performance.md holds the figures, each with
the command that prints it.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

# Suite name -> module of this package whose main(argv) runs it.
SUITES = {"peer": "peer", "adapters": "adapters", "scaling": "scaling", "pipeline": "pipeline",
          "badinput": "bad_input", "faults": "faults", "soak": "soak", "packing": "packing",
          "plan": "plan", "torch": "torch_peer", "startup": "startup", "long-rows": "long_rows",
          "serve": "serve_peer"}


def run_bench(suite: str | None, args: list[str]) -> int:
    """Dispatch `meshtune bench <suite> [options]`; with no suite, --help lists the suites."""
    if suite is None:
        if "-h" in args or "--help" in args:
            print(suites_help())
            return 0
        raise ValueError(f"no bench suite given; run meshtune bench SUITE with one of {', '.join(SUITES)} "
                         "(meshtune bench --help says what each measures)")
    if suite not in SUITES:
        raise ValueError(f"unknown bench suite '{suite}'; choose {', '.join(SUITES)}")
    return importlib.import_module(f".{SUITES[suite]}", __name__).main(args)


def suites_help() -> str:
    """Every suite with one line: the first line of its module's docstring, read without importing it."""
    lines = ["usage: meshtune bench SUITE [options]   (meshtune bench SUITE --help: that suite's options)", "",
             "suites:"]
    for name, module in SUITES.items():
        source = Path(__file__).with_name(f"{module}.py").read_text(encoding="utf-8")
        first = (ast.get_docstring(ast.parse(source)) or "").strip().splitlines()[:1] or [""]
        summary = re.sub(r"^`meshtune bench [^`]*`:\s*", "", first[0])
        lines.append(f"  {name:<10}{summary}")
    return "\n".join(lines)
