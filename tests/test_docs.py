"""The docs a newcomer reads: README stays a front door (the two setup commands, at most 200
lines) and every relative link in README.md, ARCHITECTURE.md and docs/ resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "scripts/demo.sh" in text and "scripts/test.sh" in text
    for doc in (
        "docs/library.md",
        "docs/speculative-decoding.md",
        "docs/server.md",
        "docs/models.md",
        "docs/performance.md",
    ):
        assert f"]({doc})" in text, doc


def test_relative_links_resolve() -> None:
    broken = []
    for doc in _docs():
        for target in LINK.findall(doc.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken
