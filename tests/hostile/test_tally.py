"""docs/reliability.md shows the current tally of the hostile cases."""

from __future__ import annotations

import pathlib

import tally

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "reliability.md"


def test_reliability_page_has_the_current_tally() -> None:
    text = PAGE.read_text()
    assert tally.rewrite(text) == text, "regenerate it: python3 tests/hostile/tally.py docs/reliability.md"


def test_every_hostile_module_has_cases() -> None:
    assert tally.modules(), "no tests/hostile/test_hostile_*.py found"
    for line in tally.table().splitlines()[2:-1]:
        assert int(line.split("|")[2]) > 0, line
