# SPDX-License-Identifier: Apache-2.0
"""The README stays short and every page under docs/ is linked from it; no relative link is broken."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md"))
# [text](target) with a relative target, its #anchor dropped.
LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_at_most_200_lines() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = ROOT / "README.md"
    linked = {(readme.parent / t).resolve() for t in LINK.findall(readme.read_text())}
    assert PAGES and not [p.relative_to(ROOT) for p in PAGES if p not in linked]


@pytest.mark.parametrize(
    "page",
    [ROOT / "README.md", ROOT / "examples" / "README.md", *PAGES],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_relative_links_resolve(page: Path) -> None:
    broken = [t for t in LINK.findall(page.read_text()) if not (page.parent / t).exists()]
    assert not broken, broken
