"""Every reference in the code and the docs leads somewhere inside the repository: no
document that is not in it is cited, every ``docs/….md`` a file names exists, and every
"design rule N" / "convention N" is one that docs/design.md numbers."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Built from parts, so this file does not name them itself.
OUTSIDE = re.compile(
    "|".join(["STYLE" + r"(?: rule|:)", "ARCHITECTURE" + r"\.md", "NATS" + "-NOTES"])
)
DOC_PATH = re.compile(r"docs/[\w./-]+\.md")
RULE = re.compile(r"(?:design rule|docs/design\.md, rule) (\d+)")
CONVENTION = re.compile(r"convention (\d+)")


def sources() -> list[Path]:
    files = [*ROOT.glob("jetloop/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("docs/*.md")]
    return [p for p in files if "node_modules" not in p.parts] + [ROOT / "README.md"]


def numbered(section: str) -> int:
    """How many numbered items the first list after ``section`` in docs/design.md has."""
    text = (ROOT / "docs/design.md").read_text()
    after = text[text.index(section) :]
    items = re.findall(r"^(\d+)\. \*\*", after.split("\n## ", 1)[0], re.M)
    return len(items)


def test_no_reference_leaves_the_repository() -> None:
    """No file names a document that lives outside the repository."""
    found = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in sources()
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not found, found


def test_every_docs_path_and_rule_named_exists() -> None:
    """A ``docs/….md`` named in code or docs exists; a design rule or convention number is
    one docs/design.md has."""
    rules = numbered("## The rules, and where they are kept")
    conventions = numbered("And the ways the code is written")
    assert rules >= 7 and conventions >= 5, (rules, conventions)
    missing, bad = [], []
    for p in sources():
        text = p.read_text()
        for m in DOC_PATH.finditer(text):
            if not (ROOT / m.group(0)).exists() and not (ROOT / "docs" / m.group(0)).exists():
                missing.append(f"{p.relative_to(ROOT)}: {m.group(0)}")
        for m in RULE.finditer(text):
            if not 1 <= int(m.group(1)) <= rules:
                bad.append(f"{p.relative_to(ROOT)}: {m.group(0)}")
        if "design.md" in text:
            for m in CONVENTION.finditer(text):
                if not 1 <= int(m.group(1)) <= conventions:
                    bad.append(f"{p.relative_to(ROOT)}: {m.group(0)}")
    assert not missing, missing
    assert not bad, bad
