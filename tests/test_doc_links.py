"""Every relative link in the documents leads somewhere: README.md, conformance/README.md and
docs/**/*.md link to files that exist, and a ``#fragment`` to a heading the target has
(GitHub's heading ids)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "conformance" / "README.md", *ROOT.glob("docs/**/*.md")]


def prose(path: Path) -> str:
    """The document without its fenced code, where ``](`` is code, not a link."""
    return FENCE.sub("", path.read_text())


def slug(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The ids of a document's headings (a repeated heading gets ``-1``, ``-2``, …)."""
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(prose(path)):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links() -> list[str]:
    broken = []
    for doc in documents():
        for m in LINK.finditer(prose(doc)):
            target = m.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
                continue
            where, _, fragment = target.partition("#")
            path = (doc.parent / where).resolve() if where else doc
            name = f"{doc.relative_to(ROOT)}: {target}"
            if not path.exists():
                broken.append(f"{name} (no such file)")
            elif fragment and path.suffix == ".md" and fragment not in anchors(path):
                broken.append(f"{name} (no such heading)")
    return broken


def test_every_relative_link_resolves() -> None:
    """A link to a file that is not in the repository, or to a heading its target does not
    have, fails here, named."""
    assert broken_links() == []


def test_heading_ids_are_githubs() -> None:
    """The slugs are GitHub's: code, colons and angle brackets dropped, so the protocol's
    control API heading is ``the-control-api-jlcontrolopwho``."""
    assert slug("The control API: `jl.control.<op>.<who>`") == "the-control-api-jlcontrolopwho"
    assert slug("Dead letters: `jl.dead.<original subject>`") == (
        "dead-letters-jldeadoriginal-subject"
    )
    assert "the-control-api-jlcontrolopwho" in anchors(ROOT / "docs" / "protocol.md")
