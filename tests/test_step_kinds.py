"""A step kind is described once (``jetloop.schemas.kinds`` for the wire, the router for the
engine), every kind has its pool, key and handler, and a step of a kind no row describes is
dead-lettered with the kind in the reason, never run or acked."""

from __future__ import annotations

import inspect

import msgpack

from jetloop.consumers.router import HANDLER_OF_KIND
from jetloop.schemas import WIRE_OF_KIND, StepKind, StepMessage
from jetloop.services.client import Client
from jetloop.streams import topology
from jetloop.streams.bus import step_out, subject_of
from tests.conftest import WorkerFactory, call, script, until

# The wire as it was before the table: (subject, key) of a step of each kind in session s1,
# turn t1, model step 2, call 3. A change here is a change of the protocol.
WIRE = {
    StepKind.RUN_MODEL: ("jl.step.model.a.run_model.s1", "s1.t1.m2"),
    StepKind.CALL_TOOL: ("jl.step.tool.a.call_tool.s1", "s1.t1.m2.c3"),
    StepKind.CALL_SINGLE_ATTEMPT_TOOL: (
        "jl.step.tool.a.call_single_attempt_tool.s1",
        "s1.t1.m2.c3",
    ),
    # Added since (a model step's calls in one message): a kind of its own, a key of its own.
    StepKind.CALL_TOOLS: ("jl.step.tool.a.call_tools.s1", "s1.t1.m2.calls"),
    StepKind.AWAIT_TOOL_APPROVAL: ("jl.step.tool.a.await_tool_approval.s1", "s1.t1.m2.c3.approval"),
    StepKind.AWAIT_QUESTION_ANSWER: (
        "jl.step.tool.a.await_question_answer.s1",
        "s1.t1.m2.c3.answer",
    ),
    StepKind.AWAIT_TIMER: ("jl.step.tool.a.await_timer.s1", "s1.t1.m2.c3.timer"),
    StepKind.POLL_TOOL_TASK: ("jl.step.tool.a.poll_tool_task.s1", "s1.t1.m2.c3.poll"),
    StepKind.AWAIT_DELEGATION: ("jl.step.tool.a.await_delegation.s1", "s1.t1.m2.c3.child"),
    StepKind.COMPACT_CONTEXT: ("jl.step.model.a.compact_context.s1", "s1.t1.m2.compact"),
    StepKind.JOIN: ("jl.step.session.a.join.s1", "s1.t1.m2.c3.join"),
    StepKind.TURN_DONE: ("jl.step.session.a.turn_done.s1", "s1.t1.done"),
    StepKind.CLOSE_TURN: ("jl.step.session.a.close_turn.s1", "s1.t1.close"),
}


def step(kind: StepKind, wake: str | None = None) -> StepMessage:
    return StepMessage(
        kind=kind, agent="a", session_id="s1", turn_id="t1", model_step=2, call_index=3, wake=wake
    )


def test_every_kind_has_a_pool_a_key_and_a_handler() -> None:
    """Each ``StepKind`` has a row in the wire table (a pool some worker serves, a key that
    starts with its turn) and a handler in the router; neither table has a row too many."""
    missing = []
    for kind in StepKind:
        wire = WIRE_OF_KIND.get(kind)
        if wire is None or wire.pool not in topology.POOLS:
            missing.append(f"{kind}: no pool")
        elif not step(kind).step_key().startswith("s1.t1"):
            missing.append(f"{kind}: no key")
        handler = HANDLER_OF_KIND.get(kind)
        if handler is None or not inspect.iscoroutinefunction(handler):
            missing.append(f"{kind}: no handler")
    assert missing == []
    assert set(WIRE_OF_KIND) == set(HANDLER_OF_KIND) == set(StepKind)


def test_the_wire_of_every_kind_is_unchanged() -> None:
    """Subjects, keys and headers of every kind are byte for byte what they were before the
    kinds were described in one table; a wake is appended to the key."""
    assert set(WIRE) == set(StepKind)
    for kind, (subject, key) in WIRE.items():
        out = step_out(step(kind))
        assert (out.subject, out.headers["Nats-Msg-Id"]) == (subject, key), kind
        assert subject_of(step(kind)) == subject
        assert out.headers == {
            "Nats-Msg-Id": key,
            "Jl-Kind": kind.value,
            "Jl-Session": "s1",
            "Jl-Step": key,
            "Jl-Schema": "1",
            "Jl-Turn": "t1",
            "Jl-Agent": "a",
        }
        assert step(kind, wake="w1").step_key() == f"{key}.w1"


async def test_a_step_of_an_unknown_kind_is_dead_lettered(
    client: Client, workers: WorkerFactory
) -> None:
    """A step whose kind no row describes (subject, header and body alike) is a newer
    jetloop's: handed back for a worker that knows it, and dead-lettered with the kind named
    in the reason once none took it within JETLOOP_NEWER_WRITER_SECONDS (3 s here); a known
    kind sent on another pool's subject is dead-lettered at once. Neither is run or acked,
    and the worker serves on."""
    w = workers.start(env={"JETLOOP_NEWER_WRITER_SECONDS": "3"})
    # Published once the worker serves: a step it first meets past the window (a slow
    # start on a busy machine) is dead-lettered at once, without the hand-back asserted below.
    await w.wait_for("worker.started", timeout=30)
    unknown = {"kind": "frobnicate", "agent": "tester", "session_id": "uk", "turn_id": "t1"}
    await client.js.publish(
        "jl.step.tool.tester.frobnicate.uk",
        msgpack.packb(unknown),
        headers={"Nats-Msg-Id": "uk.t1.frob", "Jl-Kind": "frobnicate", "Jl-Session": "uk"},
    )
    astray = {"kind": "turn_done", "agent": "tester", "session_id": "uk", "turn_id": "t1"}
    await client.js.publish(
        "jl.step.tool.tester.turn_done.uk",
        msgpack.packb(astray),
        headers={"Nats-Msg-Id": "uk.t1.done", "Jl-Kind": "turn_done", "Jl-Session": "uk"},
    )
    h = await client.send("tester", "uk-next", script([call("write", name="after")]))
    await client.wait(h, timeout=30)
    assert w.alive()

    async def both() -> dict[str, str] | None:
        dead = {subject: reason for subject, reason, _ in await client.dead_letters()}
        return dead if len(dead) == 2 else None

    dead = await until(both, timeout=15)
    reason = dead["jl.step.tool.tester.frobnicate.uk"]
    assert "unknown step kind 'frobnicate'" in reason, reason
    assert "run_model" in reason  # and which kinds this worker knows
    reason = dead["jl.step.tool.tester.turn_done.uk"]
    assert "does not match its body" in reason, reason
    assert "'jl.step.session.tester.turn_done.uk'" in reason, reason
    assert "no worker that reads it took it in 3 s" in dead["jl.step.tool.tester.frobnicate.uk"]
    assert w.find("step.newer_writer", step="uk.t1.frob")  # handed back first
    assert w.find("step.error") == []  # refused at decode: never a retry
    assert len(w.find("step.dead_letter", kind="frobnicate")) == 1  # termed there, not acked
