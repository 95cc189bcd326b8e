"""The maintainer tools in tools/ run: each one briefly, into a temporary folder."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "meshtune" / "assets"
TOOLS = ROOT / "tools"


def test_every_tool_says_its_purpose_and_is_listed() -> None:
    listed = (TOOLS / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    for tool in sorted(TOOLS.glob("*.py")):
        doc = ast.get_docstring(ast.parse(tool.read_text()))
        assert doc and doc.splitlines()[0].strip(), f"{tool.name}: no one-line purpose opening its docstring"
        assert f"`{tool.name}`" in listed, f"{tool.name} is not listed in tools/README.md"
        assert f"tools/{tool.name}" in makefile, f"{tool.name} has no make target"


def test_make_tiny_model_writes_the_shipped_files(tmp_path: Path) -> None:
    """A two-step build writes every shipped file; all but the trained weights byte for byte."""
    proc = subprocess.run([sys.executable, str(TOOLS / "make_tiny_model.py"), "--out-dir", str(tmp_path),
                           "--steps", "2", "--docs", "200"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "pretraining done" in proc.stdout and "base exact match on test:" in proc.stdout, proc.stdout[-2000:]

    folders = ("tiny-llama", "data/arithmetic")
    shipped = sorted(p.relative_to(ASSETS) for f in folders for p in (ASSETS / f).iterdir() if p.is_file())
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert written == shipped
    weights = Path("tiny-llama/model.safetensors")
    for rel in shipped:
        if rel != weights:
            assert (tmp_path / rel).read_bytes() == (ASSETS / rel).read_bytes(), f"{rel} differs from the shipped one"

    new, old = mx.load(str(tmp_path / weights)), mx.load(str(ASSETS / weights))
    assert {k: v.shape for k, v in new.items()} == {k: v.shape for k, v in old.items()}
    assert all(v.dtype == mx.float32 for v in new.values())

    splits = {s: [json.loads(line) for line in (tmp_path / "data/arithmetic" / f"{s}.jsonl").read_text().splitlines()]
              for s in ("train", "valid", "test")}
    assert {s: len(rows) for s, rows in splits.items()} == {"train": 2000, "valid": 200, "test": 100}
    prompts = [{row["prompt"] for row in rows} for rows in splits.values()]
    assert not (prompts[0] & prompts[1] or prompts[0] & prompts[2] or prompts[1] & prompts[2])
