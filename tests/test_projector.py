"""The read model projector (issue 6): every event applied exactly once, whatever kills it."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from jetloop.schemas import Event, EventType, HistoryEntry, HistoryRole, encode
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer
from jetloop.services.readmodel.model import Incoming, ReadModel
from jetloop.services.readmodel.projector import Projector
from jetloop.streams import topology
from tests.conftest import TEST_ENV, WorkerFactory, call, script, until


def position_of(db: Path) -> int:
    """The projected position, read the way another process would (0: nothing yet)."""
    if not db.exists():
        return 0
    try:
        with closing(sqlite3.connect(db)) as conn:
            row = conn.execute("SELECT last_seq FROM position").fetchone()
    except sqlite3.OperationalError:
        return 0  # the tables are not there yet
    return int(row[0]) if row else 0


async def dump(db: Path) -> dict[str, list[tuple[Any, ...]]]:
    async with await ReadModel.open(db, readonly=True) as model:
        return await model.dump()


class ProjectorProcess:
    """``python -m jetloop.services.readmodel.projector`` as a subprocess that can be SIGKILLed."""

    def __init__(self, url: str, db: Path, log: Path, hold: str | None = None) -> None:
        env = {**os.environ, **TEST_ENV, "JETLOOP_LOG_LEVEL": "debug"}
        if hold:
            env["JETLOOP_FAULT_HOLD"] = hold
        out = open(log, "ab")  # handed to the child
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jetloop.services.readmodel.projector",
                "--nats",
                url,
                "--db",
                str(db),
                "--batch=3",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        out.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def projectors() -> Iterator[list[ProjectorProcess]]:
    procs: list[ProjectorProcess] = []
    yield procs
    for p in procs:
        p.kill()


def ev(seq: int, kind: EventType, turn: str, **data: Any) -> Incoming:
    e = Event(
        key=f"s.{turn}.{kind.value}", type=kind, session_id="s", turn_id=turn, at=seq, data=data
    )
    return Incoming(seq, topology.event_subject("s", kind.value), encode(e))


async def test_batches_apply_once(tmp_path: Path) -> None:
    """A batch seen again is skipped by its sequence; an event re-published under a new
    sequence undoes nothing; batch boundaries do not change the result."""
    user = HistoryEntry(key="s.t1.user", role=HistoryRole.USER, turn_id="t1", text="find zebras")
    log = [
        ev(1, EventType.TURN_ACCEPTED, "t1", request_id="r1", queued=False),
        Incoming(2, topology.history_subject("s", "user"), encode(user)),
        ev(3, EventType.TURN_STARTED, "t1", request_id="r1", agent="a"),
        ev(
            4,
            EventType.MODEL_ANSWERED,
            "t1",
            model_step=0,
            calls=[{"call_id": "c", "tool": "read", "args": {"x": 1}, "effect": "read"}],
        ),
        ev(
            5,
            EventType.CALL_OUTCOME,
            "t1",
            call_key="s.t1.0.0",
            tool="read",
            effect="read",
            state="succeeded",
            attempts=1,
        ),
        ev(6, EventType.TURN_COMPLETED, "t1", request_id="r1", text="2 zebras", model_steps=2),
        Incoming(7, "jl.event.s.turn.started", b"\xc1 not msgpack"),
        # The same started event again, under a later sequence (after the dedupe window).
        ev(8, EventType.TURN_STARTED, "t1", request_id="r1", agent="a"),
    ]
    async with await ReadModel.open(tmp_path / "a.sqlite") as a:
        await a.prepare()
        first = await a.apply(log[:4])
        assert (first.applied, first.position) == (4, 4)
        again = await a.apply(log[:5])
        assert (again.skipped, again.applied, again.position) == (4, 1, 5)
        rest = await a.apply(log[5:])
        assert (rest.applied, rest.unreadable, rest.position) == (2, 1, 8)
        got_a = await a.dump()
        page = await a.list_sessions(q="ZEBRA")
    async with await ReadModel.open(tmp_path / "b.sqlite") as b:
        await b.prepare()
        await b.apply(log)
        assert await b.dump() == got_a
    [turn] = got_a["turns"]
    assert turn[:5] == ("s", "t1", "r1", "a", "completed")
    [row] = page.sessions
    assert (
        row["status"] == "idle" and row["turns_completed"] == 1 and row["last_answer"] == "2 zebras"
    )
    assert [c[9] for c in got_a["calls"]] == ["succeeded"]


async def test_killed_projector_matches_a_rebuild(
    client: Client,
    workers: WorkerFactory,
    nats_ready: EmbeddedServer,
    tmp_path: Path,
    projectors: list[ProjectorProcess],
) -> None:
    """A projector SIGKILLed after committing a batch it never acked, and again later,
    ends with exactly the read model a rebuild from the start makes."""
    workers.start()
    db = tmp_path / "readmodel.sqlite"
    handles = [
        await client.send(
            "tester",
            "p1",
            script([call("write", name="a"), call("read", name="b")], [call("read", name="c")]),
        ),
        await client.send("tester", "p2", script([call("guarded", name="g")])),
        await client.send("tester", "p3", script([call("ask_user", question="Which floor?")])),
        await client.send("tester", "p4", script([call("write", name="first")])),
        await client.send("tester", "p4", script([call("read", name="queued")])),
    ]

    # Killed holding its first committed batch, before the ack.
    projectors.append(
        ProjectorProcess(nats_ready.url, db, tmp_path / "p-a.log", hold="projector.before_ack")
    )
    await until(lambda: _async(position_of(db) > 0))
    projectors[-1].kill()
    held = position_of(db)

    # Killed again once it has caught up with what exists; more events come meanwhile.
    projectors.append(ProjectorProcess(nats_ready.url, db, tmp_path / "p-b.log"))
    snap2 = await until(lambda: _waiting(client, "p2", "approvals"))
    snap3 = await until(lambda: _waiting(client, "p3", "questions"))
    last = (await client.js.stream_info(topology.EVENTS_STREAM)).state.last_seq
    await until(lambda: _async(position_of(db) >= last))
    projectors[-1].kill()
    assert position_of(db) > held

    await client.approve("p2", snap2.approvals[0].approval_id, by="alice")
    await client.answer("p3", snap3.questions[0].question_id, "the third", by="bob")
    for h in handles:
        await client.wait(h, timeout=30)

    async def all_idle() -> bool:
        for sid in ("p1", "p2", "p3", "p4"):
            snap = await client.snapshot(sid)
            if snap is None or snap.status != "idle":
                return False
        return True

    await until(all_idle)
    projectors.append(ProjectorProcess(nats_ready.url, db, tmp_path / "p-c.log"))
    last = (await client.js.stream_info(topology.EVENTS_STREAM)).state.last_seq
    await until(lambda: _async(position_of(db) >= last))
    projectors[-1].kill()
    survived = await dump(db)

    fresh = tmp_path / "rebuilt.sqlite"
    await Projector([nats_ready.url], fresh, durable="jl_check", burst=True, batch=64).run()
    assert await dump(fresh) == survived
    # Rebuild mode on the same file drops its tables and replays to the same rows.
    await Projector([nats_ready.url], db, rebuild=True, burst=True).run()
    assert await dump(db) == survived

    async with await ReadModel.open(db, readonly=True) as model:
        page = await model.list_sessions()
        rows = {r["session_id"]: r for r in page.sessions}
        assert set(rows) == {"p1", "p2", "p3", "p4"}
        assert all(r["status"] == "idle" for r in rows.values())
        assert rows["p4"]["turns_completed"] == 2
        assert rows["p2"]["pending_approvals"] == 0 and rows["p3"]["open_questions"] == 0
        assert (await model.list_sessions(q="no such words")).total == 0
        assert (await model.list_sessions(q="Which floor")).total == 1
    approvals = survived["approvals"]
    assert [(a[0], a[6], a[7]) for a in approvals] == [("p2", "approved", "alice")]
    [question] = survived["questions"]
    assert question[5:7] == ("the third", "bob")


async def _async(value: Any) -> Any:
    return value


async def _waiting(client: Client, session: str, field: str) -> Any:
    snap = await client.snapshot(session)
    return snap if snap is not None and getattr(snap, field) else None
