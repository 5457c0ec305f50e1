"""Every invocation of every tool of the app under test, in a file the kills cannot reach.

The crash test watches a user's tools, it does not change them: ``watch`` gives each tool of
kind call or task a function that writes a row to the ledger (SQLite, outside the store),
committed before the tool's own function starts, then calls that function as it is and
writes how it ended. A worker killed inside a tool leaves a row with no end: the invocation
happened. The judge (``jetloop.tooling.crashtest.judge``) reads the rows against the state.
Between the row and the function, the fault point ``tool.running``: a crash test that kills
there kills a tool that has started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jetloop.agents.agent import App
from jetloop.agents.tools import Tool, ToolContext, ToolKind
from jetloop.consumers.faults import Faults

_SCHEMA = """
CREATE TABLE IF NOT EXISTS invocations (
    id INTEGER PRIMARY KEY,
    tool TEXT NOT NULL,
    effect TEXT NOT NULL,
    session_id TEXT NOT NULL,
    turn_id TEXT NOT NULL,
    call_id TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    started REAL NOT NULL,
    ended REAL,
    outcome TEXT
)
"""
WATCHED = (ToolKind.CALL, ToolKind.TASK)


@dataclass(frozen=True)
class Invocation:
    tool: str
    effect: str
    session_id: str
    turn_id: str
    call_id: str
    idempotency_key: str
    attempt: int
    pid: int
    started: float
    ended: float | None
    outcome: str | None  # "ok", "error: …", "not sent: …", or None: the process died inside


def call_key_of(inv: Invocation) -> str:
    """The call key (``<session>.<turn>.<model step>.<index>``) of an invocation, whose
    call id is ``<turn>-<model step>-<index>``."""
    return f"{inv.session_id}.{inv.call_id.replace('-', '.')}"


class Ledger:
    """The ledger file. Each write is its own short transaction (several worker processes
    append to one file, one after the other)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _db(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30, isolation_level=None)

    def create(self) -> None:
        """Made once, by the test, before any worker writes (WAL stays set in the file)."""
        with _closing(self._db()) as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(_SCHEMA)

    def started(self, tool: Tool, ctx: ToolContext) -> int:
        with _closing(self._db()) as db:
            cur = db.execute(
                "INSERT INTO invocations (tool, effect, session_id, turn_id, call_id,"
                " idempotency_key, attempt, pid, started) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    tool.name,
                    tool.effect.value,
                    ctx.session_id,
                    ctx.turn_id,
                    ctx.call_id,
                    ctx.idempotency_key,
                    ctx.attempt,
                    os.getpid(),
                    time.time(),
                ),
            )
            assert cur.lastrowid is not None
            return cur.lastrowid

    def ended(self, row: int, outcome: str) -> None:
        with _closing(self._db()) as db:
            db.execute(
                "UPDATE invocations SET ended = ?, outcome = ? WHERE id = ?",
                (time.time(), outcome, row),
            )

    @property
    def lines_path(self) -> Path:
        """Where a tool worker in another language writes its invocations (JSON lines,
        ``JETLOOP_CRASHTEST_INVOCATIONS``): beside the ledger, read with it."""
        return self.path.with_suffix(".jsonl")

    def invocations(self) -> list[Invocation]:
        with _closing(self._db()) as db:
            rows = db.execute(
                "SELECT tool, effect, session_id, turn_id, call_id, idempotency_key, attempt,"
                " pid, started, ended, outcome FROM invocations ORDER BY id"
            ).fetchall()
        found = [Invocation(*r) for r in rows] + _lines(self.lines_path)
        return sorted(found, key=lambda i: i.started)


def _lines(path: Path) -> list[Invocation]:
    """The invocations a tool worker in another language wrote: a line
    ``{"row", "tool", "effect", "session_id", "turn_id", "call_id", "idempotency_key",
    "attempt", "pid", "started"}`` synced to disk before the tool's function starts, then
    ``{"row", "ended", "outcome"}`` when it ends (``outcome`` as ``Invocation`` says). A row
    with no end is a tool its process died inside; a line cut short by the kill is skipped."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    started: dict[str, dict[str, Any]] = {}
    ends: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or not isinstance(row.get("row"), str):
            continue
        (ends if "ended" in row else started)[row["row"]] = row
    out = []
    for key, r in started.items():
        end = ends.get(key, {})
        try:
            inv = Invocation(
                tool=str(r["tool"]),
                effect=str(r["effect"]),
                session_id=str(r["session_id"]),
                turn_id=str(r["turn_id"]),
                call_id=str(r["call_id"]),
                idempotency_key=str(r["idempotency_key"]),
                attempt=int(r["attempt"]),
                pid=int(r["pid"]),
                started=float(r["started"]),
                ended=float(end["ended"]) if "ended" in end else None,
                outcome=str(end["outcome"]) if "outcome" in end else None,
            )
        except (KeyError, TypeError, ValueError):
            continue  # not a row this format has: the judge reads what it can trust
        out.append(inv)
    return out


class _closing:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        return self.db

    def __exit__(self, *exc: object) -> None:
        self.db.close()


# The point a crash test may hold at once the invocation is in the ledger, before the tool's
# own function starts (``jetloop.consumers.faults``): a kill there is a kill inside the tool.
RUNNING = "tool.running"
# The outcome of an invocation whose call never reached the tool's vendor
# (``RetryableToolError(not_sent=True)``, an MCP server that could not be reached).
NOT_SENT = "not sent"


def watched_tool(tool: Tool, ledger: Ledger, faults: Faults) -> Tool:
    """``tool`` with its function watched: the same name, arguments, effect and policy."""
    inner = tool.fn

    async def fn(args: Any, ctx: ToolContext) -> Any:
        row = await asyncio.to_thread(ledger.started, tool, ctx)
        await faults.point(RUNNING)
        try:
            result = await inner(args, ctx)
        except BaseException as exc:
            # A call that never reached the vendor ran nothing: the judge does not count it.
            said = NOT_SENT if getattr(exc, "not_sent", False) else "error"
            await asyncio.shield(asyncio.to_thread(ledger.ended, row, f"{said}: {exc!r}"[:500]))
            raise
        await asyncio.to_thread(ledger.ended, row, "ok")
        return result

    return dataclasses.replace(tool, fn=fn)


def watch(app: App, ledger: Ledger, faults: Faults | None = None) -> App:
    """The app with every call and task tool of every agent watched (its MCP servers' too)."""
    faults = faults or Faults()
    agents = []
    for agent in app.agents.values():

        def wrap(t: Tool) -> Tool:
            return watched_tool(t, ledger, faults) if t.kind in WATCHED else t

        tools = tuple(wrap(t) for t in agent.tools)
        # An MCP server's tools are watched as it lists them.
        servers = tuple(s.watched(wrap) for s in agent.mcp_servers)
        agents.append(dataclasses.replace(agent, tools=tools, mcp_servers=servers))
    return App(agents)
