"""The read model: ``JL_EVENTS`` projected into SQLite, for listing and searching sessions.

One module on purpose (~700 lines): the tables, the exactly-once apply and the queries that
read them change together — a column added in one place and not the others is the bug a
split would invite.

The projector (``jetloop.services.readmodel.projector``) is its only writer; the gateway reads it
(``GET /v1/sessions``). Every row is derived from the events alone — times from ``Event.at``,
order from the stream sequence, never from the clock — so dropping the tables and replaying
the stream from the start (a rebuild) gives the same rows as a projector that ran all along.

Exactly once: a batch of messages is applied in one SQLite transaction together with the
highest stream sequence it holds (table ``position``); a message whose sequence is at or
below the stored one was applied already and is skipped. An event seen twice under two
sequences (re-published after the stream's dedupe window) is not counted twice and undoes
nothing: rows are upserts keyed by identity, the audit keeps the first copy of each event
key, and states only move forward. The same log always gives the same rows.

Tables: ``sessions`` (one row per session, recomputed from the others), ``turns``,
``calls``, ``approvals``, ``questions``, ``audit`` (every event, by key) and ``position``.
Call states here are the read model's view of the log, a superset of ``CallState``: a call
is ``planned`` when the model asked for it, then ``awaiting_approval`` / ``approved`` /
``rejected``, ``awaiting_answer`` / ``answered``, ``waiting_timer`` / ``timer_fired``,
``task_running``, and finally the state of its ``call.outcome``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiosqlite
import structlog

from jetloop.schemas import DecodeError, Event, EventType, HistoryEntry, HistoryRole, decode
from jetloop.schemas.events import (
    ApprovalDecidedData,
    ApprovalRequestedData,
    CallOutcomeData,
    CallReconciledData,
    EventData,
    ModelAnsweredData,
    ModelUsageData,
    QuestionAnsweredData,
    QuestionAskedData,
    TaskStartedData,
    TimerFiredData,
    TimerSetData,
    TurnAcceptedData,
    TurnCancelledData,
    TurnCompletedData,
    TurnFailedData,
    TurnStartedData,
)
from jetloop.sessions.usage import UsageLine
from jetloop.streams.topology import EVENTS_STREAM

log = structlog.get_logger("jetloop.readmodel")

# Bumped when the tables change: a read model of another version is rebuilt from the log.
# 2: an audit row is (stream sequence, part): an entry of the folded log carries several.
SCHEMA_VERSION = 2

TABLES = ("sessions", "turns", "calls", "approvals", "questions", "audit", "position")

DDL = (
    """CREATE TABLE IF NOT EXISTS position (
        stream TEXT PRIMARY KEY,
        last_seq INTEGER NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS sessions (
        session_id TEXT PRIMARY KEY,
        agent TEXT,
        status TEXT,
        created_at REAL,
        updated_at REAL,
        last_turn_id TEXT,
        turns_total INTEGER NOT NULL DEFAULT 0,
        turns_completed INTEGER NOT NULL DEFAULT 0,
        turns_failed INTEGER NOT NULL DEFAULT 0,
        turns_cancelled INTEGER NOT NULL DEFAULT 0,
        pending_approvals INTEGER NOT NULL DEFAULT 0,
        open_questions INTEGER NOT NULL DEFAULT 0,
        last_text TEXT,
        last_answer TEXT,
        last_seq INTEGER NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX IF NOT EXISTS sessions_recent ON sessions (updated_at DESC, session_id)",
    """CREATE TABLE IF NOT EXISTS turns (
        session_id TEXT NOT NULL,
        turn_id TEXT NOT NULL,
        request_id TEXT,
        agent TEXT,
        status TEXT,
        user_text TEXT,
        answer_text TEXT,
        error TEXT,
        cancelled_by TEXT,
        model_steps INTEGER,
        accepted_seq INTEGER,
        accepted_at REAL,
        started_at REAL,
        ended_at REAL,
        PRIMARY KEY (session_id, turn_id)
    )""",
    """CREATE TABLE IF NOT EXISTS calls (
        call_key TEXT PRIMARY KEY,
        session_id TEXT NOT NULL,
        turn_id TEXT NOT NULL,
        model_step INTEGER,
        call_index INTEGER,
        call_id TEXT,
        tool TEXT,
        effect TEXT,
        args TEXT,
        state TEXT,
        attempts INTEGER,
        error TEXT,
        settlement TEXT,
        approval_id TEXT,
        question_id TEXT,
        timer_due REAL,
        task_handle TEXT,
        reconciled_by TEXT,
        reconciled_at REAL,
        updated_at REAL
    )""",
    "CREATE INDEX IF NOT EXISTS calls_turn ON calls (session_id, turn_id)",
    """CREATE TABLE IF NOT EXISTS approvals (
        session_id TEXT NOT NULL,
        approval_id TEXT NOT NULL,
        turn_id TEXT,
        call_key TEXT,
        tool TEXT,
        args TEXT,
        status TEXT,
        decided_by TEXT,
        reason TEXT,
        requested_at REAL,
        decided_at REAL,
        PRIMARY KEY (session_id, approval_id)
    )""",
    """CREATE TABLE IF NOT EXISTS questions (
        session_id TEXT NOT NULL,
        question_id TEXT NOT NULL,
        turn_id TEXT,
        call_key TEXT,
        question TEXT,
        answer TEXT,
        answered_by TEXT,
        asked_at REAL,
        answered_at REAL,
        PRIMARY KEY (session_id, question_id)
    )""",
    """CREATE TABLE IF NOT EXISTS audit (
        seq INTEGER NOT NULL,
        part INTEGER NOT NULL DEFAULT 0,
        key TEXT NOT NULL UNIQUE,
        session_id TEXT NOT NULL,
        turn_id TEXT,
        type TEXT NOT NULL,
        at REAL NOT NULL,
        data TEXT NOT NULL,
        PRIMARY KEY (seq, part)
    )""",
    "CREATE INDEX IF NOT EXISTS audit_session ON audit (session_id, seq)",
    # The usage ledger's lines are audit rows of type model.usage (``usage_lines``).
    "CREATE INDEX IF NOT EXISTS audit_type ON audit (type, session_id)",
)

# States only move forward: a re-published older event must not undo a later one.
TURN_RANK = {"queued": 0, "running": 1, "completed": 2, "failed": 2, "cancelled": 2}
CALL_RANK = {
    "planned": 0,
    "awaiting_approval": 1,
    "awaiting_answer": 1,
    "waiting_timer": 1,
    "task_running": 1,
    "approved": 2,
    "rejected": 2,
    "answered": 2,
    "timer_fired": 2,
    "succeeded": 3,
    "failed": 3,
    "outcome_unknown": 3,
    "denied": 3,
    "cancelled": 3,
}
WAITING_CALLS = ("awaiting_approval", "awaiting_answer", "waiting_timer", "task_running")
OPEN_CALLS = (*WAITING_CALLS, "planned", "approved", "answered", "timer_fired")
SESSION_STATUSES = ("idle", "running", "waiting")
# What a session waits for, by the state of its waiting call.
WAITING_FOR = {
    "awaiting_approval": "approval",
    "awaiting_answer": "answer",
    "waiting_timer": "timer",
    "task_running": "task",
}


class ReadModelMissing(Exception):
    """The read model's file does not exist yet (no projector has run)."""


@dataclass(frozen=True)
class Incoming:
    """One message of ``JL_EVENTS`` as the projector fetched it."""

    seq: int
    subject: str
    data: bytes


@dataclass
class Applied:
    """What one batch did: how many messages it applied, skipped (seen) or could not read."""

    applied: int = 0
    skipped: int = 0
    unreadable: int = 0
    position: int = 0
    sessions: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class SessionPage:
    total: int
    sessions: list[dict[str, Any]]


def _rank_case(column: str, ranks: Mapping[str, int]) -> str:
    whens = " ".join(f"WHEN '{state}' THEN {rank}" for state, rank in ranks.items())
    return f"(CASE {column} {whens} ELSE -1 END)"


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _session_of(subject: str) -> str | None:
    parts = subject.split(".")
    if len(parts) < 4 or parts[0] != "jl" or parts[1] != "event":
        return None
    return parts[2]


# SQLite makes the -wal and -shm files with the database file's permissions.
SIDE_FILES = ("", "-wal", "-shm", "-journal")


def owner_only(path: Path) -> None:
    """The read model holds every conversation: its file is made 0600 before SQLite opens it
    (so the -wal and -shm files SQLite makes beside it are 0600 too), and one made before
    that, with wider permissions, is tightened if it is ours."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        return
    except FileExistsError:
        pass
    for suffix in SIDE_FILES:
        side = path.with_name(path.name + suffix)
        try:
            st = side.stat()
            if st.st_mode & 0o077 and st.st_uid == os.geteuid():
                side.chmod(0o600)
                log.info("readmodel.made_private", path=str(side), was=oct(st.st_mode & 0o777))
        except FileNotFoundError:
            continue


def _like(q: str) -> str:
    escaped = q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


class ReadModel:
    """One SQLite connection to the read model; the writer applies batches, readers query."""

    def __init__(self, db: aiosqlite.Connection, path: Path) -> None:
        self.db = db
        self.path = path

    @classmethod
    async def open(cls, path: Path, readonly: bool = False) -> ReadModel:
        """Open (the writer creates the file); a reader fails with ``ReadModelMissing``."""
        path = Path(path)
        if readonly:
            if not path.exists():
                raise ReadModelMissing(str(path))
            # Read-write at the file level (WAL readers need the -shm file), but no writes.
            db = await aiosqlite.connect(f"file:{path}?mode=rw", uri=True, isolation_level=None)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            owner_only(path)
            db = await aiosqlite.connect(path, isolation_level=None)
        try:
            db.row_factory = aiosqlite.Row
            await db.execute("PRAGMA busy_timeout = 5000")
            if readonly:
                await db.execute("PRAGMA query_only = ON")
            else:
                # WAL: the gateway reads while the projector writes. NORMAL sync may lose the
                # last batches on power loss, but the position goes with them: replayed.
                await db.execute("PRAGMA journal_mode = WAL")
                await db.execute("PRAGMA synchronous = NORMAL")
        except BaseException:
            await db.close()
            raise
        return cls(db, path)

    async def close(self) -> None:
        await self.db.close()

    async def __aenter__(self) -> ReadModel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- schema ------------------------------------------------------------------------

    async def prepare(self, rebuild: bool = False) -> bool:
        """Create the tables; drop them first on ``rebuild`` or when their version differs.

        Returns whether the model starts empty (so the projector replays from the start).
        """
        async with self.db.execute("PRAGMA user_version") as cur:
            row = await cur.fetchone()
        version = int(row[0]) if row else 0
        async with self.db.execute(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'position'"
        ) as cur:
            row = await cur.fetchone()
        exists = bool(row and row[0])
        if exists and version != SCHEMA_VERSION and not rebuild:
            log.warning("readmodel.version_changed", found=version, want=SCHEMA_VERSION)
            rebuild = True
        await self.db.execute("BEGIN IMMEDIATE")
        try:
            if rebuild:
                for table in TABLES:
                    await self.db.execute(f"DROP TABLE IF EXISTS {table}")
            for stmt in DDL:
                await self.db.execute(stmt)
            await self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            await self.db.execute("COMMIT")
        except BaseException:
            await self.db.execute("ROLLBACK")
            raise
        return rebuild or not exists

    async def position(self) -> int:
        """The stream sequence of the last message applied (0: none)."""
        async with self.db.execute(
            "SELECT last_seq FROM position WHERE stream = ?", (EVENTS_STREAM,)
        ) as cur:
            row = await cur.fetchone()
        return int(row[0]) if row else 0

    # --- writing -----------------------------------------------------------------------

    async def apply(self, batch: Sequence[Incoming]) -> Applied:
        """Apply a batch in one transaction with its position; seen sequences are skipped."""
        out = Applied()
        await self.db.execute("BEGIN IMMEDIATE")
        try:
            pos = await self.position()
            out.position = pos
            for item in batch:
                if item.seq <= out.position:
                    out.skipped += 1
                    continue
                out.position = item.seq
                sid = _session_of(item.subject)
                if sid is None:
                    out.unreadable += 1
                    continue
                try:
                    await self._apply_one(item)
                except DecodeError as exc:
                    # A body this version cannot read: counted and passed over, not retried
                    # forever; a rebuild with newer code picks it up.
                    log.warning("readmodel.unreadable", seq=item.seq, error=str(exc))
                    out.unreadable += 1
                    continue
                out.applied += 1
                out.sessions.add(sid)
            for sid in sorted(out.sessions):
                await self._refresh_session(sid)
            if out.position > pos:
                await self.db.execute(
                    "INSERT INTO position (stream, last_seq) VALUES (?, ?) "
                    "ON CONFLICT (stream) DO UPDATE SET last_seq = excluded.last_seq",
                    (EVENTS_STREAM, out.position),
                )
            await self.db.execute("COMMIT")
        except BaseException:
            await self.db.execute("ROLLBACK")
            raise
        return out

    async def _apply_one(self, item: Incoming) -> None:
        parts = item.subject.split(".")
        if parts[3] == "history":
            entry = decode(HistoryEntry, item.data)
            # (Before any write: data that does not fit is unreadable, the whole entry.)
            told = [(ev, ev.payload()) for ev in entry.events]
            await self._history(parts[2], entry)
            for part, (ev, data) in enumerate(told):  # the folded log (jetloop.schemas.log)
                await self._apply_event(item.seq, part, ev, data)
            return
        ev = decode(Event, item.data)
        await self._apply_event(item.seq, 0, ev, ev.payload())

    async def _apply_event(self, seq: int, part: int, ev: Event, data: EventData | None) -> None:
        await self.db.execute(
            "INSERT OR IGNORE INTO audit (seq, part, key, session_id, turn_id, type, at, data) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (seq, part, ev.key, ev.session_id, ev.turn_id, ev.type.value, ev.at, _json(ev.data)),
        )
        await self._merge("sessions", {"session_id": ev.session_id}, {})
        await self.db.execute(
            "UPDATE sessions SET created_at = COALESCE(created_at, ?), "
            "updated_at = max(COALESCE(updated_at, 0), ?), last_seq = ? WHERE session_id = ?",
            (ev.at, ev.at, seq, ev.session_id),
        )
        await self._event(seq, ev, data)

    async def _history(self, session_id: str, entry: HistoryEntry) -> None:
        # Only the user's words are needed (search); answers come with turn.completed.
        if entry.role == HistoryRole.USER:
            await self._merge(
                "turns",
                {"session_id": session_id, "turn_id": entry.turn_id},
                {"user_text": entry.text},
            )

    async def _event(self, seq: int, ev: Event, data: EventData | None) -> None:
        sid, tid = ev.session_id, ev.turn_id or ""
        turn = {"session_id": sid, "turn_id": tid}
        match data:
            case TurnAcceptedData():
                await self._merge(
                    "turns", turn, {"request_id": data.request_id, "accepted_at": ev.at}
                )
                await self.db.execute(
                    "UPDATE turns SET accepted_seq = COALESCE(accepted_seq, ?) "
                    "WHERE session_id = ? AND turn_id = ?",
                    (seq, sid, tid),
                )
                await self._advance_turn(sid, tid, "queued")
            case TurnStartedData():
                await self._merge(
                    "turns",
                    turn,
                    {"request_id": data.request_id, "agent": data.agent, "started_at": ev.at},
                )
                await self._advance_turn(sid, tid, "running")
            case ModelAnsweredData():
                n = data.model_step
                await self._merge("turns", turn, {})
                await self.db.execute(
                    "UPDATE turns SET model_steps = max(COALESCE(model_steps, 0), ?) "
                    "WHERE session_id = ? AND turn_id = ?",
                    (n + 1, sid, tid),
                )
                for i, c in enumerate(data.calls):
                    key = f"{sid}.{tid}.{n}.{i}"
                    await self._merge(
                        "calls",
                        {"call_key": key},
                        {
                            "session_id": sid,
                            "turn_id": tid,
                            "model_step": n,
                            "call_index": i,
                            "call_id": c.call_id,
                            "tool": c.tool,
                            "effect": c.effect,
                            "args": _json(c.args),
                        },
                    )
                    await self._advance_call(key, "planned", ev.at)
            case TurnCompletedData():
                values = {"answer_text": data.text, "model_steps": data.model_steps}
                await self._end_turn(ev, data.request_id, "completed", values)
            case TurnFailedData():
                await self._end_turn(ev, data.request_id, "failed", {"error": data.error})
            case TurnCancelledData():
                await self._end_turn(ev, data.request_id, "cancelled", {"cancelled_by": data.by})
            case CallOutcomeData():
                key = data.call_key
                await self._call(key, sid, tid)
                await self.db.execute(
                    "UPDATE calls SET tool = COALESCE(?, tool), effect = COALESCE(?, effect), "
                    "attempts = ?, error = ?, settlement = ? "
                    "WHERE call_key = ? AND reconciled_by IS NULL",
                    (data.tool, data.effect, data.attempts, data.error, data.settlement, key),
                )
                await self._advance_call(key, data.state, ev.at)
            case ApprovalRequestedData():
                key, aid = data.call_key, data.approval_id
                await self._merge(
                    "approvals",
                    {"session_id": sid, "approval_id": aid},
                    {
                        "turn_id": tid,
                        "call_key": key,
                        "tool": data.tool,
                        "args": _json(data.args),
                        "requested_at": ev.at,
                    },
                )
                await self.db.execute(
                    "UPDATE approvals SET status = COALESCE(status, 'pending') "
                    "WHERE session_id = ? AND approval_id = ?",
                    (sid, aid),
                )
                await self._call(key, sid, tid, approval_id=aid)
                await self._advance_call(key, "awaiting_approval", ev.at)
            case ApprovalDecidedData():
                key, aid, status = data.call_key, data.approval_id, data.status
                # The first decision wins (as in state): a decided approval keeps its decision.
                await self._merge(
                    "approvals", {"session_id": sid, "approval_id": aid}, {"turn_id": tid}
                )
                await self.db.execute(
                    "UPDATE approvals SET status = ?, decided_by = ?, reason = ?, "
                    "decided_at = ?, call_key = COALESCE(call_key, ?) "
                    "WHERE session_id = ? AND approval_id = ? AND COALESCE(status, 'pending') = "
                    "'pending'",
                    (status, data.by, data.reason, ev.at, key, sid, aid),
                )
                await self._call(key, sid, tid, approval_id=aid)
                decided = "approved" if status == "approved" else "rejected"
                await self._advance_call(key, decided, ev.at)
            case QuestionAskedData():
                key, qid = data.call_key, data.question_id
                await self._merge(
                    "questions",
                    {"session_id": sid, "question_id": qid},
                    {
                        "turn_id": tid,
                        "call_key": key,
                        "question": data.question,
                        "asked_at": ev.at,
                    },
                )
                await self._call(key, sid, tid, question_id=qid)
                await self._advance_call(key, "awaiting_answer", ev.at)
            case QuestionAnsweredData():
                key, qid = data.call_key, data.question_id
                await self._merge(
                    "questions", {"session_id": sid, "question_id": qid}, {"turn_id": tid}
                )
                await self.db.execute(
                    "UPDATE questions SET answer = ?, answered_by = ?, answered_at = ?, "
                    "call_key = COALESCE(call_key, ?) "
                    "WHERE session_id = ? AND question_id = ? AND answered_at IS NULL",
                    (data.answer, data.by, ev.at, key, sid, qid),
                )
                await self._call(key, sid, tid, question_id=qid)
                await self._advance_call(key, "answered", ev.at)
            case TimerSetData():
                await self._call(data.call_key, sid, tid, timer_due=data.due)
                await self._advance_call(data.call_key, "waiting_timer", ev.at)
            case TimerFiredData():
                await self._call(data.call_key, sid, tid)
                await self._advance_call(data.call_key, "timer_fired", ev.at)
            case TaskStartedData():
                await self._call(data.call_key, sid, tid, task_handle=_json(data.handle))
                await self._advance_call(data.call_key, "task_running", ev.at)
            case CallReconciledData():
                await self._call(data.call_key, sid, tid)
                # Reconciling settles an outcome_unknown call for good: it overrides the outcome.
                await self.db.execute(
                    "UPDATE calls SET state = ?, error = ?, settlement = 'reconciled', "
                    "reconciled_by = ?, reconciled_at = ?, updated_at = ? "
                    "WHERE call_key = ? AND reconciled_by IS NULL",
                    (data.state, data.error, data.by, ev.at, ev.at, data.call_key),
                )
            case _:
                pass  # crash resumptions, compactions and the like live in the audit only

    async def _end_turn(
        self, ev: Event, request_id: str, status: str, values: dict[str, Any]
    ) -> None:
        turn = {"session_id": ev.session_id, "turn_id": ev.turn_id or ""}
        await self._merge("turns", turn, {"request_id": request_id, "ended_at": ev.at, **values})
        await self._advance_turn(ev.session_id, ev.turn_id or "", status)

    async def _merge(self, table: str, keys: Mapping[str, Any], values: Mapping[str, Any]) -> None:
        """Insert the row, or fill in the given non-null values of the existing one."""
        cols = [*keys, *values]
        sql = (
            f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)}) "
            f"ON CONFLICT ({', '.join(keys)}) DO "
        )
        if values:
            sql += "UPDATE SET " + ", ".join(f"{c} = COALESCE(excluded.{c}, {c})" for c in values)
        else:
            sql += "NOTHING"
        await self.db.execute(sql, [*keys.values(), *values.values()])

    async def _call(self, key: str, sid: str, tid: str, **values: Any) -> None:
        parts = key.split(".")
        where: dict[str, Any] = {"session_id": sid, "turn_id": tid}
        if len(parts) == 4 and parts[2].isdigit() and parts[3].isdigit():
            where |= {"model_step": int(parts[2]), "call_index": int(parts[3])}
        await self._merge("calls", {"call_key": key}, {**where, **values})

    async def _advance_turn(self, sid: str, tid: str, status: str) -> None:
        await self.db.execute(
            f"UPDATE turns SET status = ? WHERE session_id = ? AND turn_id = ? "
            f"AND {_rank_case('status', TURN_RANK)} < ?",
            (status, sid, tid, TURN_RANK[status]),
        )

    async def _advance_call(self, key: str, state: str, at: float) -> None:
        rank = CALL_RANK.get(state, 3)
        await self.db.execute(
            f"UPDATE calls SET state = ?, updated_at = ? WHERE call_key = ? "
            f"AND reconciled_by IS NULL AND {_rank_case('state', CALL_RANK)} < ?",
            (state, at, key, rank),
        )

    async def _refresh_session(self, sid: str) -> None:
        """Recompute the session's summary row from its turns, calls and waits."""
        q = self.db.execute
        async with q(
            "SELECT count(*), "
            "sum(status = 'completed'), sum(status = 'failed'), sum(status = 'cancelled'), "
            "sum(status IN ('queued', 'running')) FROM turns WHERE session_id = ?",
            (sid,),
        ) as cur:
            counts = await cur.fetchone()
        assert counts is not None
        async with q(
            "SELECT turn_id, agent, user_text, answer_text FROM turns WHERE session_id = ? "
            "ORDER BY accepted_seq IS NULL, accepted_seq DESC, turn_id DESC LIMIT 1",
            (sid,),
        ) as cur:
            last = await cur.fetchone()
        async with q(
            "SELECT agent FROM turns WHERE session_id = ? AND agent IS NOT NULL "
            "ORDER BY accepted_seq DESC LIMIT 1",
            (sid,),
        ) as cur:
            agent_row = await cur.fetchone()
        async with q(
            "SELECT count(*) FROM approvals WHERE session_id = ? AND status = 'pending'", (sid,)
        ) as cur:
            approvals = await cur.fetchone()
        async with q(
            "SELECT count(*) FROM questions WHERE session_id = ? AND answered_at IS NULL", (sid,)
        ) as cur:
            questions = await cur.fetchone()
        open_marks = ", ".join(f"'{s}'" for s in OPEN_CALLS)
        waiting_marks = ", ".join(f"'{s}'" for s in WAITING_CALLS)
        async with q(
            f"SELECT count(*), sum(c.state IN ({waiting_marks})) FROM calls c "
            "JOIN turns t ON t.session_id = c.session_id AND t.turn_id = c.turn_id "
            f"WHERE c.session_id = ? AND t.status = 'running' AND c.state IN ({open_marks})",
            (sid,),
        ) as cur:
            calls = await cur.fetchone()
        active = int(counts[4] or 0)
        open_calls = int(calls[0] or 0) if calls else 0
        waiting_calls = int(calls[1] or 0) if calls else 0
        if not active:
            status = "idle"
        elif open_calls and open_calls == waiting_calls:
            status = "waiting"
        else:
            status = "running"
        await q(
            "UPDATE sessions SET agent = ?, status = ?, last_turn_id = ?, turns_total = ?, "
            "turns_completed = ?, turns_failed = ?, turns_cancelled = ?, pending_approvals = ?, "
            "open_questions = ?, last_text = ?, last_answer = ? WHERE session_id = ?",
            (
                agent_row[0] if agent_row else None,
                status,
                last[0] if last else None,
                int(counts[0] or 0),
                int(counts[1] or 0),
                int(counts[2] or 0),
                int(counts[3] or 0),
                int(approvals[0]) if approvals else 0,
                int(questions[0]) if questions else 0,
                last[2] if last else None,
                last[3] if last else None,
                sid,
            ),
        )

    # --- reading -----------------------------------------------------------------------

    async def list_sessions(
        self,
        q: str | None = None,
        status: str | None = None,
        agent: str | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> SessionPage:
        """Sessions, most recently active first; ``q`` searches ids, agents and texts."""
        where: list[str] = []
        args: list[Any] = []
        if q:
            like = _like(q)
            where.append(
                "(s.session_id LIKE ? ESCAPE '\\' OR s.agent LIKE ? ESCAPE '\\' OR EXISTS ("
                "SELECT 1 FROM turns t WHERE t.session_id = s.session_id AND "
                "(t.user_text LIKE ? ESCAPE '\\' OR t.answer_text LIKE ? ESCAPE '\\')))"
            )
            args += [like, like, like, like]
        if status in SESSION_STATUSES:
            where.append("s.status = ?")
            args.append(status)
        elif status == "approval":
            where.append("s.pending_approvals > 0")
        elif status == "answer":
            where.append("s.open_questions > 0")
        elif status == "failed":
            where.append(
                "EXISTS (SELECT 1 FROM turns t WHERE t.session_id = s.session_id AND "
                "t.turn_id = s.last_turn_id AND t.status = 'failed')"
            )
        if agent:
            where.append("s.agent = ?")
            args.append(agent)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        async with self.db.execute(f"SELECT count(*) FROM sessions s {clause}", args) as cur:
            row = await cur.fetchone()
        total = int(row[0]) if row else 0
        async with self.db.execute(
            f"SELECT * FROM sessions s {clause} "
            "ORDER BY s.updated_at DESC, s.session_id LIMIT ? OFFSET ?",
            [*args, limit, offset],
        ) as cur:
            rows = await cur.fetchall()
        sessions = [dict(r) for r in rows]
        await self._add_details(sessions)
        return SessionPage(total, sessions)

    async def _add_details(self, sessions: list[dict[str, Any]]) -> None:
        """What a person wants to read of each row of a page: the last turn's status and
        what the session waits for (one query per page, whatever the table holds)."""
        if not sessions:
            return
        ids = [r["session_id"] for r in sessions]
        marks = ", ".join("?" for _ in ids)
        async with self.db.execute(
            f"SELECT s.session_id, t.status FROM sessions s JOIN turns t ON "
            f"t.session_id = s.session_id AND t.turn_id = s.last_turn_id "
            f"WHERE s.session_id IN ({marks})",
            ids,
        ) as cur:
            last = {r[0]: r[1] for r in await cur.fetchall()}
        waits = ", ".join(f"'{s}'" for s in WAITING_CALLS)
        async with self.db.execute(
            f"SELECT DISTINCT c.session_id, c.state FROM calls c JOIN turns t ON "
            f"t.session_id = c.session_id AND t.turn_id = c.turn_id "
            f"WHERE c.session_id IN ({marks}) AND t.status = 'running' AND c.state IN ({waits})",
            ids,
        ) as cur:
            waiting: dict[str, list[str]] = {}
            for sid, state in await cur.fetchall():
                waiting.setdefault(sid, []).append(WAITING_FOR[state])
        for r in sessions:
            r["last_turn_status"] = last.get(r["session_id"])
            r["waiting_for"] = sorted(waiting.get(r["session_id"], []))

    async def inbox(self, limit: int = 50, offset: int = 0) -> tuple[int, list[dict[str, Any]]]:
        """Pending approvals and open questions across sessions, newest first, of turns that
        have not ended (a cancelled turn's approval is no one's business any more)."""
        live = (
            "NOT EXISTS (SELECT 1 FROM turns t WHERE t.session_id = x.session_id AND "
            "t.turn_id = x.turn_id AND t.status IN ('completed', 'failed', 'cancelled'))"
        )
        union = (
            "SELECT 'approval' AS kind, session_id, approval_id AS id, turn_id, call_key, tool, "
            "args, NULL AS question, requested_at AS at FROM approvals x "
            f"WHERE status = 'pending' AND {live} UNION ALL "
            "SELECT 'question', session_id, question_id, turn_id, call_key, NULL, NULL, "
            f"question, asked_at FROM questions x WHERE answered_at IS NULL AND {live}"
        )
        async with self.db.execute(f"SELECT count(*) FROM ({union})") as cur:
            row = await cur.fetchone()
        total = int(row[0]) if row else 0
        async with self.db.execute(
            f"SELECT * FROM ({union}) ORDER BY at DESC, session_id, id LIMIT ? OFFSET ?",
            (limit, offset),
        ) as cur:
            items = [dict(r) for r in await cur.fetchall()]
        for item in items:
            item["args"] = json.loads(item["args"]) if item["args"] else None
        return total, items

    async def turn_row(self, session_id: str, turn_id: str) -> dict[str, Any] | None:
        async with self.db.execute(
            "SELECT * FROM turns WHERE session_id = ? AND turn_id = ?", (session_id, turn_id)
        ) as cur:
            row = await cur.fetchone()
        return dict(row) if row else None

    async def turn_calls(self, session_id: str, turn_id: str, limit: int) -> list[dict[str, Any]]:
        async with self.db.execute(
            "SELECT * FROM calls WHERE session_id = ? AND turn_id = ? "
            "ORDER BY model_step, call_index LIMIT ?",
            (session_id, turn_id, limit),
        ) as cur:
            return [dict(r) for r in await cur.fetchall()]

    async def turn_events(
        self, session_id: str, turn_id: str, after: int, limit: int
    ) -> list[dict[str, Any]]:
        """The turn's events in log order after stream sequence ``after`` (the audit), from
        at most ``limit`` messages (an entry of the folded log may carry several events: a
        page ends after all of them)."""
        async with self.db.execute(
            "SELECT seq, key, type, at, data FROM audit WHERE session_id = ? AND turn_id = ? "
            "AND seq IN (SELECT DISTINCT seq FROM audit WHERE session_id = ? AND turn_id = ? "
            "AND seq > ? ORDER BY seq LIMIT ?) ORDER BY seq, part",
            (session_id, turn_id, session_id, turn_id, after, limit),
        ) as cur:
            return [dict(r) for r in await cur.fetchall()]

    async def event(self, session_id: str, seq: int) -> dict[str, Any] | None:
        async with self.db.execute(
            "SELECT seq, key, type, turn_id, at, data FROM audit WHERE session_id = ? AND seq = ? "
            "ORDER BY part LIMIT 1",
            (session_id, seq),
        ) as cur:
            row = await cur.fetchone()
        return dict(row) if row else None

    async def usage_lines(self, session_id: str | None = None) -> list[UsageLine]:
        """The usage ledger as projected: every ``model.usage`` event, of one session or of
        all, in log order (``jetloop.sessions.usage`` totals them)."""
        sql = "SELECT key, session_id, turn_id, at, data FROM audit WHERE type = ?"
        args: tuple[Any, ...] = (EventType.MODEL_USAGE.value,)
        if session_id is not None:
            sql += " AND session_id = ?"
            args += (session_id,)
        async with self.db.execute(sql + " ORDER BY seq, part", args) as cur:
            rows = await cur.fetchall()
        return [
            UsageLine.recorded(
                r["key"],
                r["session_id"],
                r["turn_id"] or "",
                r["at"],
                ModelUsageData.model_validate(json.loads(r["data"])),
            )
            for r in rows
        ]

    async def dump(self, tables: Iterable[str] = TABLES) -> dict[str, list[tuple[Any, ...]]]:
        """Every row of every table, in key order: to compare two read models."""
        out: dict[str, list[tuple[Any, ...]]] = {}
        for table in tables:
            async with self.db.execute(f"SELECT * FROM {table} ORDER BY 1, 2") as cur:
                out[table] = [tuple(r) for r in await cur.fetchall()]
        return out
