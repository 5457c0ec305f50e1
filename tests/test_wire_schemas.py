"""The machine-readable wire (docs/schemas/) is current, and the event data it describes is
what the engine really writes."""

from __future__ import annotations

from typing import Any

import msgpack
from nats.js.errors import NotFoundError

from jetloop.schemas import EVENT_DATA, EventType
from jetloop.services.client import Client
from jetloop.streams import topology
from jetloop.tooling.wire_schemas import OUT, render, stale
from tests.conftest import WorkerFactory, call, script, until


def test_checked_in_schemas_are_current() -> None:
    """A model changed without `python -m jetloop.tooling.wire_schemas` fails here, naming
    the file."""
    assert stale() == [], "stale schema files: run `python -m jetloop.tooling.wire_schemas`"
    assert len(render()) == len(list(OUT.glob("*.json")))


def test_every_event_type_but_the_reserved_one_has_a_data_schema() -> None:
    """``task.polled`` is reserved (never written); every other type's data is described."""
    assert set(EventType) - set(EVENT_DATA) == {EventType.TASK_POLLED}


async def _stored_events(client: Client) -> list[dict[str, Any]]:
    out, seq = [], 1
    while True:
        try:
            m = await client.js.get_msg(
                topology.EVENTS_STREAM, seq=seq, subject="jl.event.>", next=True
            )
        except NotFoundError:
            return out
        out.append(msgpack.unpackb(m.data or b""))
        seq = (m.seq or seq) + 1


async def test_written_event_data_matches_its_schema(
    client: Client, workers: WorkerFactory
) -> None:
    """One turn that calls a write, an approval-gated tool, a question, a timer, a task and a
    delegation; a failed turn; a cancelled turn: every event written has exactly the fields
    of its type's data model (none missing, none unknown)."""
    workers.start()
    calls = [
        call("write", name="w"),
        call("guarded", name="g"),
        call("ask_user", question="colour?"),
        call("wait", seconds=0.2),
        call("export", name="e", polls=1),
        call("delegate", agent="tester", task=script(answer="child")),
    ]
    h = await client.send("tester", "ev", script(calls))

    async def pending() -> Any:
        snap = await client.snapshot("ev")
        return snap if snap and snap.approvals and snap.questions else None

    snap = await until(pending, timeout=30)
    await client.approve("ev", snap.approvals[0].approval_id)
    await client.answer("ev", snap.questions[0].question_id, "blue")
    await client.wait(h, timeout=30)

    failed = await client.send("tester", "ev-fail", '{"fail_at_step": 0}')
    slow = await client.send("tester", "ev-cancel", script([call("patient", name="p", seconds=20)]))

    async def running() -> bool:
        snap = await client.snapshot("ev-cancel")
        return snap is not None and bool(snap.calls)

    await until(running, timeout=30)
    await client.cancel("ev-cancel")
    for handle in (failed, slow):

        async def ended(handle: Any = handle) -> bool:
            t = await client.turn(handle.session_id, handle.turn_id)
            return t is not None and t.status.terminal

        await until(ended, timeout=30)

    seen: set[str] = set()
    for ev in await _stored_events(client):
        if "role" in ev:
            continue  # a history entry (history-entry.json)
        etype = ev["type"]
        model = EVENT_DATA[EventType(etype)]
        data = ev.get("data", {})
        model.model_validate(data)
        assert set(data) <= set(model.model_fields), (etype, set(data) - set(model.model_fields))
        seen.add(etype)
    assert {
        "turn.accepted",
        "turn.started",
        "model.answered",
        "call.outcome",
        "turn.completed",
        "turn.failed",
        "turn.cancelled",
        "approval.requested",
        "approval.decided",
        "question.asked",
        "question.answered",
        "timer.set",
        "timer.fired",
        "task.started",
        "delegation.started",
    } <= seen, seen
