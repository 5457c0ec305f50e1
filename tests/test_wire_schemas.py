"""The machine-readable wire (docs/schemas/) is current, and the event data it describes is
what the engine really writes."""

from __future__ import annotations

import json
from typing import Any

import msgpack
from jsonschema import Draft202012Validator
from nats.js.errors import NotFoundError

from jetloop.schemas import EVENT_DATA, EventType
from jetloop.services.client import Client
from jetloop.streams import topology
from jetloop.tooling.wire_schemas import OUT, RECORDS, render, stale
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
    stored = await _stored_events(client)
    # A history entry (history-entry.json) of the folded log carries events in its `events`.
    carried = [e for entry in stored if "role" in entry for e in entry.get("events") or []]
    for ev in [*(e for e in stored if "role" not in e), *carried]:
        etype = ev["type"]
        model = EVENT_DATA[EventType(etype)]
        data = ev.get("data", {})
        model.model_validate(data)
        assert set(data) == set(model.model_fields), (etype, set(data) ^ set(model.model_fields))
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


def strict(schema: Any) -> Any:
    """The schema with every object closed (``additionalProperties: false`` where it lists
    properties and says nothing else): what a client that generates exact types assumes."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


async def test_stored_records_match_their_schema_strictly(
    client: Client, workers: WorkerFactory
) -> None:
    """Every record in jl_state after a turn with a write, an approval, a question and a read
    (a session, turns, calls, an approval, a question, the step's reads kept together)
    validates against its checked-in schema with every object closed: ``seal`` included, in
    its v3 form."""
    w = workers.start()
    await w.wait_for("worker.step_reads", now=True, timeout=30)
    calls = [call("write", name="w"), call("guarded", name="g"), call("ask_user", question="?")]
    calls.append(call("read", name="r"))
    h = await client.send("tester", "rs", script(calls))

    async def pending() -> Any:
        snap = await client.snapshot("rs")
        return snap if snap and snap.approvals and snap.questions else None

    snap = await until(pending, timeout=30)
    await client.approve("rs", snap.approvals[0].approval_id)
    await client.answer("rs", snap.questions[0].question_id, "blue")
    await client.wait(h, timeout=30)

    # The first token of a jl_state key, and its record's schema (docs/protocol.md, "State").
    prefixes = {
        "session": "session-record",
        "turn": "turn-record",
        "call": "call-record",
        "approval": "approval-record",
        "question": "question-record",
        "compact": "compaction-record",
        "reads": "step-reads",
    }
    assert set(prefixes.values()) == set(RECORDS)
    kv = await client.js.key_value(topology.STATE_BUCKET)
    seen = set()
    for key in await kv.keys():
        prefix = key.split(".", 1)[0]
        if prefix not in prefixes:
            continue
        entry = await kv.get(key)
        record = msgpack.unpackb(entry.value or b"")
        schema = json.loads((OUT / f"{prefixes[prefix]}.json").read_text())
        errors = [e.message for e in Draft202012Validator(strict(schema)).iter_errors(record)]
        assert not errors, (key, errors)
        assert record["seal"].startswith("v3."), key
        seen.add(prefix)
    assert {"session", "turn", "call", "approval", "question", "reads"} <= seen, seen
