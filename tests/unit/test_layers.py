"""The package's layers only look down: import-linter's layers contract in pyproject.toml, run by its own
command, and every top-level module of meshtune placed in exactly one layer."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp

try:
    import tomllib
except ImportError:  # Python 3.10: import-linter brings tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _layers() -> list[list[str]]:
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    assert contract["type"] == "layers"
    return [[m.strip() for m in layer.replace(":", "|").split("|")] for layer in contract["layers"]]


def test_every_top_level_module_has_a_layer():
    graph = grimp.build_graph("meshtune")
    tops = {".".join(m.split(".")[:2]) for m in graph.modules if m.count(".") >= 1}
    placed = [m for layer in _layers() for m in layer]
    assert len(placed) == len(set(placed)), "a module sits in two layers"
    assert tops == set(placed), f"not placed: {sorted(tops - set(placed))}; gone: {sorted(set(placed) - tops)}"


def test_no_module_imports_from_a_layer_above_its_own():
    command = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert command, "import-linter is a test dependency (pip install -e '.[test]')"
    done = subprocess.run([command, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "1 kept, 0 broken" in done.stdout
