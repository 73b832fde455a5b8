"""The documentation a user reads, README.md and docs/*.md, as the tests that run its examples see it: the fenced
blocks of a language, each with the page that holds it, so a test keeps checking an example whichever page it moves
to."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = (README, *sorted((ROOT / "docs").glob("*.md")))
"""README.md first, then docs/*.md by name."""


def code_blocks(lang: str, pages: tuple[Path, ...] = PAGES) -> list[tuple[Path, str]]:
    """Every fenced block of ``lang`` (```bash, ```yaml, ...) in ``pages``, in page order: (page, text)."""
    return [
        (page, block)
        for page in pages
        for block in re.findall(rf"```{lang}\n(.*?)```", page.read_text(), flags=re.S)
    ]


def the_block(lang: str, marker: str) -> tuple[Path, str]:
    """The one ``lang`` block of all pages that contains ``marker`` (an example the tests run)."""
    found = [(page, block) for page, block in code_blocks(lang) if marker in block]
    assert len(found) == 1, (lang, marker, [str(page) for page, _ in found])
    return found[0]
