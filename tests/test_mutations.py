"""The mutation check inside the suite (``tests/mutations.py``).

Every listed mutation still applies (its snippet is found exactly once) and names tests
that exist; the CI subset is applied to a copy of the project and caught by its tests.
``JETLOOP_MUTATIONS=all`` runs every mutation here instead (``pytest -m mutation``); the
full run is also ``python -m tests.mutations --all`` (docs/crash-matrix.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mutations import BY_NAME, CI_SUBSET, MUTATIONS, apply, check, copy_tree, env_for

NAMES = [m.name for m in MUTATIONS] if os.environ.get("JETLOOP_MUTATIONS") == "all" else CI_SUBSET


def test_every_mutation_applies_and_names_tests_that_exist(tmp_path: Path) -> None:
    """A snippet the code no longer has, or a test that was renamed, fails here (not only
    in the full run): the list cannot rot silently."""
    assert len(BY_NAME) == len(MUTATIONS), "two mutations share a name"
    assert set(CI_SUBSET) <= set(BY_NAME)
    tree = copy_tree(tmp_path)
    for m in MUTATIONS:
        assert m.tests, f"{m.name} names no test"
        original = (tree / m.path).read_text()
        apply(m, tree)
        (tree / m.path).write_text(original)
    node_ids = sorted({t for m in MUTATIONS for t in m.tests})
    got = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            *node_ids,
        ],
        cwd=tree,
        env=env_for(tree),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == 0, f"a named test does not exist:\n{got.stdout[-2000:]}"


@pytest.mark.mutation
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", NAMES)
def test_mutation_is_caught(name: str) -> None:
    """The engine with this one bug fails at least one of the tests that claim to catch it."""
    r = check(BY_NAME[name])
    assert r.caught, f"{name} survived ({r.mutation.bug}): {', '.join(r.mutation.tests)}"
