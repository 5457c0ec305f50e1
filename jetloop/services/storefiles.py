"""Secret files of the store directory, written so that no reader ever sees half of one.

Two ways, both 0600 and both under another name first: ``write_once`` links the draft in
place (the first of two racing writers wins; a file that exists is kept), ``replace`` moves
it over whatever was there (the last writer wins).
"""

from __future__ import annotations

import os
from pathlib import Path


def _draft(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.parent / f".{path.name}.{os.getpid()}"
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return draft


def write_once(path: Path, text: str) -> None:
    """Create ``path`` (0600) holding ``text``, unless it exists. Written whole under another
    name and then linked in place, so a process reading it beside the writer never sees a
    partial file, and of two writers racing the first one's file stays."""
    if path.exists():
        return
    draft = _draft(path, text)
    try:
        os.link(draft, path)
    except FileExistsError:
        pass  # another process made it a moment ago: that one stays
    finally:
        draft.unlink()


def replace(path: Path, text: str) -> None:
    """Write ``path`` whole (0600) under another name, then move it in place."""
    os.replace(_draft(path, text), path)
