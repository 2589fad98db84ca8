"""The serial marker (pyproject.toml: tests that run alone, after the others, in make test): every
test file that uses it spells it ``pytest.mark.serial``, the text conftest's collection under
``-m serial`` looks for to leave the other files unimported; a file that marked its tests another
way would run in neither part."""

from __future__ import annotations

import pathlib
import re

from tests.conftest import SERIAL_MARK

TESTS = pathlib.Path(__file__).parent


def test_every_file_that_uses_the_serial_marker_names_it_so():
    using = [p for p in TESTS.rglob("*.py") if p.name != "conftest.py" and p != pathlib.Path(__file__)
             and re.search(r"\bmark\.serial\b|[\"']serial[\"']", p.read_text(encoding="utf-8"))]
    assert using, "no test file uses the serial marker"
    assert [p for p in using if SERIAL_MARK not in p.read_text(encoding="utf-8")] == []
