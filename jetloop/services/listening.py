"""Where a running ``jetloop up`` listens, kept in its store directory (``up.json``).

``up`` may listen elsewhere than the defaults (``--nats-port``, ``--gateway-port``, or a free
port with 0). It writes the addresses beside ``up.lock`` once it serves, and removes them when
it stops; every command run with the same store directory and no NATS URL of its own
(``JETLOOP_NATS_URL``, ``--nats``) dials the server found here
(``jetloop.services.settings``). A file left by an ``up`` that was killed names a process that
is gone, and is not used.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from jetloop.services.storefiles import replace

LISTENING_FILE = "up.json"


@dataclass(frozen=True)
class Listening:
    pid: int
    nats_url: str
    gateway_url: str | None
    # Whether ``up`` runs the nats-server itself (and so serves a new namespace on its own);
    # with ``JETLOOP_NATS_URL`` the user's servers must learn the namespace's account first.
    embedded: bool = True


def record(
    store_dir: Path, nats_url: str, gateway_url: str | None, *, embedded: bool = True
) -> None:
    """Say where this process's ``up`` listens (``nats_url`` without credentials)."""
    body = {
        "pid": os.getpid(),
        "nats_url": nats_url,
        "gateway_url": gateway_url,
        "embedded": embedded,
    }
    replace(store_dir / LISTENING_FILE, json.dumps(body) + "\n")


def forget(store_dir: Path) -> None:
    """Remove what :func:`record` wrote, if it was this process's."""
    found = _load(store_dir)
    if found is not None and found.pid == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            (store_dir / LISTENING_FILE).unlink()


def running(store_dir: Path) -> Listening | None:
    """Where the ``up`` of ``store_dir`` listens, if one runs (its process lives)."""
    found = _load(store_dir)
    if found is None or not _alive(found.pid):
        return None
    return found


def _load(store_dir: Path) -> Listening | None:
    try:
        body = json.loads((store_dir / LISTENING_FILE).read_text())
        pid, nats_url = body["pid"], body["nats_url"]
        gateway_url = body.get("gateway_url")
        embedded = body.get("embedded", True)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none, or not ours to read: the defaults apply
    if not isinstance(pid, int) or not isinstance(nats_url, str):
        return None
    return Listening(
        pid,
        nats_url,
        gateway_url if isinstance(gateway_url, str) else None,
        embedded=embedded if isinstance(embedded, bool) else True,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True
