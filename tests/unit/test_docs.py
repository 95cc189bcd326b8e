"""The README and docs pages: relative links resolve, and the README opens with its two commands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address or an anchor on the same page
        if not (page.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_readme_opens_with_make_demo_and_make_test() -> None:
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if line.strip()]
    assert lines[0] == "# meshtune" and lines[1] == "```"
    assert lines[2].startswith("make demo ") and lines[3].startswith("make test ") and lines[4] == "```"


def test_bench_tables_are_few_each_headed_by_its_command_and_cited() -> None:
    """docs/bench keeps the reference tables the docs cite, at most 12, each opening with its command."""
    tables = sorted((ROOT / "docs" / "bench").iterdir())
    assert 0 < len(tables) <= 12, [t.name for t in tables]
    text = "\n".join(page.read_text() for page in PAGES)
    for table in tables:
        assert table.read_text().startswith("$ meshtune bench "), table.name  # rerunnable as written
        assert table.name in text, f"no page cites docs/bench/{table.name}"
