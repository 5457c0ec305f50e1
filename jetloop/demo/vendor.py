"""A small ticketing vendor on SQLite, standing in for a third-party API.

It dedupes writes on the idempotency key, as a well-behaved vendor does, and logs every
request it receives, so tests and trials can count what a crash repeated: ``requests``
holds one row per request, ``effects`` one row per write actually applied.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import aiosqlite

from jetloop.schemas.ids import DEFAULT_NAMESPACE

SCHEMA = """
CREATE TABLE IF NOT EXISTS tickets (
    id TEXT PRIMARY KEY, title TEXT NOT NULL, status TEXT NOT NULL DEFAULT 'open'
);
CREATE TABLE IF NOT EXISTS comments (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ticket TEXT NOT NULL, body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT, op TEXT NOT NULL, idem_key TEXT,
    payload TEXT NOT NULL, deduped INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS effects (
    idem_key TEXT PRIMARY KEY, op TEXT NOT NULL, result TEXT NOT NULL
);
"""


def namespaced(path: Path, namespace: str) -> Path:
    """The database of ``namespace``'s vendor: ``path`` for the default namespace (where the
    demo always kept it), else ``<stem>.<namespace><suffix>`` beside it. A tenant's tickets,
    comments and idempotency keys are then in its own file, never in another's."""
    if namespace == DEFAULT_NAMESPACE:
        return path
    return path.with_name(f"{path.stem}.{namespace}{path.suffix}")


_READY: set[Path] = set()
_INIT_LOCK = asyncio.Lock()


class Vendor:
    """Open per operation: tools run in many processes, and SQLite locks across them."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    async def _db(self) -> aiosqlite.Connection:
        if self.path not in _READY:
            async with _INIT_LOCK:
                if self.path not in _READY:
                    await self._init()
                    _READY.add(self.path)
        return await aiosqlite.connect(self.path, timeout=30)

    async def _init(self) -> None:
        # Switching to WAL answers "locked" at once, without waiting for the busy timeout,
        # when another process holds the file: retry it. Once set, WAL stays with the file.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = await aiosqlite.connect(self.path, timeout=30)
        try:
            for attempt in range(500):
                try:
                    cur = await db.execute("PRAGMA journal_mode")
                    row = await cur.fetchone()
                    if not row or str(row[0]).lower() != "wal":
                        await db.execute("PRAGMA journal_mode=WAL")
                    await db.executescript(SCHEMA)
                    return
                except sqlite3.OperationalError:
                    if attempt == 499:
                        raise
                    await asyncio.sleep(0.02)
        finally:
            await db.close()

    async def _log(
        self,
        db: aiosqlite.Connection,
        op: str,
        key: str | None,
        payload: dict[str, Any],
        deduped: bool,
    ) -> None:
        await db.execute(
            "INSERT INTO requests (op, idem_key, payload, deduped) VALUES (?, ?, ?, ?)",
            (op, key, json.dumps(payload, sort_keys=True), int(deduped)),
        )

    async def write(
        self, op: str, key: str | None, payload: dict[str, Any], dedupe: bool = True
    ) -> dict[str, Any]:
        """Apply a write once per idempotency key; a repeat returns the first result.

        ``dedupe=False`` is a vendor that ignores keys: every request applies (the key is
        still logged, so tests can count how often one call was executed).
        """
        db = await self._db()
        try:
            await db.execute("BEGIN IMMEDIATE")
            if key is not None and dedupe:
                cur = await db.execute("SELECT result FROM effects WHERE idem_key = ?", (key,))
                row = await cur.fetchone()
                if row is not None:
                    await self._log(db, op, key, payload, deduped=True)
                    await db.commit()
                    result: dict[str, Any] = json.loads(row[0])
                    return result
            result = await self._apply(db, op, payload)
            await self._log(db, op, key, payload, deduped=False)
            await db.execute(
                "INSERT INTO effects (idem_key, op, result) VALUES (?, ?, ?)",
                (
                    key if key is not None and dedupe else f"{key}#{uuid.uuid4().hex}",
                    op,
                    json.dumps(result),
                ),
            )
            await db.commit()
            return result
        finally:
            await db.close()

    async def _apply(self, db: aiosqlite.Connection, op: str, p: dict[str, Any]) -> dict[str, Any]:
        if op == "create_ticket":
            cur = await db.execute("SELECT COUNT(*) FROM tickets")
            row = await cur.fetchone()
            tid = f"T-{(row[0] if row else 0) + 1}"
            await db.execute("INSERT INTO tickets (id, title) VALUES (?, ?)", (tid, p["title"]))
            return {"id": tid, "title": p["title"], "status": "open"}
        if op == "add_comment":
            await db.execute(
                "INSERT INTO comments (ticket, body) VALUES (?, ?)", (p["ticket"], p["body"])
            )
            return {"ticket": p["ticket"], "comment": p["body"]}
        if op == "close_ticket":
            await db.execute("UPDATE tickets SET status = 'closed' WHERE id = ?", (p["ticket"],))
            return {"ticket": p["ticket"], "status": "closed"}
        # Any other op is recorded as an opaque effect (tests use their own ops).
        return {"op": op, **p}

    async def note(self, op: str, key: str | None, payload: dict[str, Any]) -> None:
        """Log a request that changes nothing (a read, a model call)."""
        db = await self._db()
        try:
            await self._log(db, op, key, payload, deduped=False)
            await db.commit()
        finally:
            await db.close()

    async def payload_counts(self, op: str) -> dict[str, int]:
        """How many requests of ``op`` carried each payload."""
        db = await self._db()
        try:
            cur = await db.execute(
                "SELECT payload, COUNT(*) FROM requests WHERE op = ? GROUP BY payload", (op,)
            )
            return {str(r[0]): int(r[1]) for r in await cur.fetchall()}
        finally:
            await db.close()

    async def read_ticket(self, ticket: str) -> dict[str, Any] | None:
        db = await self._db()
        try:
            await self._log(db, "get_ticket", None, {"ticket": ticket}, deduped=False)
            await db.commit()
            cur = await db.execute("SELECT id, title, status FROM tickets WHERE id = ?", (ticket,))
            row = await cur.fetchone()
            if row is None:
                return None
            cur = await db.execute("SELECT body FROM comments WHERE ticket = ?", (ticket,))
            comments = [r[0] for r in await cur.fetchall()]
            return {"id": row[0], "title": row[1], "status": row[2], "comments": comments}
        finally:
            await db.close()

    async def list_tickets(self) -> list[dict[str, Any]]:
        db = await self._db()
        try:
            cur = await db.execute("SELECT id, title, status FROM tickets ORDER BY rowid")
            return [{"id": r[0], "title": r[1], "status": r[2]} for r in await cur.fetchall()]
        finally:
            await db.close()

    async def request_counts(self, op: str | None = None) -> dict[str, int]:
        """Requests received and effects applied per idempotency key."""
        db = await self._db()
        try:
            q = "SELECT idem_key, COUNT(*) FROM requests"
            args: tuple[str, ...] = ()
            if op:
                q += " WHERE op = ?"
                args = (op,)
            cur = await db.execute(q + " GROUP BY idem_key", args)
            return {str(r[0]): int(r[1]) for r in await cur.fetchall()}
        finally:
            await db.close()

    async def effect_count(self, op: str | None = None) -> int:
        db = await self._db()
        try:
            q, args = "SELECT COUNT(*) FROM effects", ()
            if op:
                q, args = q + " WHERE op = ?", (op,)  # type: ignore[assignment]
            cur = await db.execute(q, args)
            row = await cur.fetchone()
            return int(row[0]) if row else 0
        finally:
            await db.close()
