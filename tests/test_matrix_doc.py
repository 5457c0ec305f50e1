"""docs/crash-matrix.md and the matrix tests stay in step."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_matrix import MODES, ROWS

DOC = Path(__file__).parent.parent / "docs" / "crash-matrix.md"


def test_every_cell_names_an_existing_test_and_every_test_is_named() -> None:
    """A cell naming a test that does not exist fails, and so does a test no cell names."""
    text = DOC.read_text()
    table = [ln for ln in text.splitlines() if ln.startswith("| ") and "test_matrix[" in ln]
    named: list[str] = []
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        failures = cells[3:6]
        assert len(failures) == 3, f"a row without three failure cells: {line}"
        for mode, cell in zip(MODES, failures, strict=True):
            ids = re.findall(r"`test_matrix\[([^\]]+)\]`", cell)
            assert len(ids) == 1, f"a cell must name exactly one test: {cell!r}"
            assert ids[0].startswith(f"{mode}-"), f"{ids[0]} is in the {mode} column"
            named.append(ids[0])
    existing = {f"{mode}-{row}" for mode in MODES for row in ROWS}
    assert sorted(set(named) - existing) == [], "cells name tests that do not exist"
    assert sorted(existing - set(named)) == [], "tests that no cell names"
    assert len(named) == len(set(named)), "a test is named twice"


def test_other_tests_the_pages_name_exist() -> None:
    """References like tests/test_x.py::test_y, in the crash-matrix and crash-resume pages,
    point at real test functions."""
    import importlib

    pages = DOC.read_text() + (DOC.parent / "crash-resume.md").read_text()
    for module, name in re.findall(r"tests/(test_\w+)\.py::(\w+)", pages):
        mod = importlib.import_module(f"tests.{module}")
        assert callable(getattr(mod, name, None)), f"tests/{module}.py::{name} does not exist"
