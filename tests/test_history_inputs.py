"""A model step finds the history entries its predecessor published beside its message.

The step before a RunModel (a turn request, a join) publishes its history entries and the
RunModel message together, one round trip, instead of confirming the entries first. The two
land in different streams, so RunModel checks that what it needs is in, reads again, and
publishes again from state what a failed publish lost. Real nats-server and stores; the
lost entries are simply never published here.

A RunModel whose message carried its records reads the history while it claims; an attempt
whose history then cannot be had is handed back unused.
"""

from __future__ import annotations

import asyncio

import pytest

from jetloop.consumers.errors import RetryLater
from jetloop.consumers.run_model import _model_step, _with_its_inputs
from jetloop.consumers.runtime import Delivery
from jetloop.schemas import (
    CallOutcome,
    CallRecord,
    CallState,
    HistoryEntry,
    PlannedCall,
    SessionRecord,
    StepKind,
    StepMessage,
    TurnPhase,
    TurnRecord,
    TurnStatus,
    call_key,
    idempotency_key,
)
from jetloop.services.embedded import EmbeddedServer
from jetloop.streams.state import Versioned, call_state_key, session_key, turn_key
from tests.test_heartbeat import delivery as delivery

SID = "inputs"


def _turn(tid: str, step: int, calls: int) -> TurnRecord:
    return TurnRecord(
        session_id=SID,
        turn_id=tid,
        agent="tester",
        request_id=tid,
        text="hello there",
        status=TurnStatus.RUNNING,
        model_step=step,
        phase=TurnPhase.MODEL,
        calls=[
            PlannedCall(
                index=i,
                call_id=f"{tid}-0-{i}",
                tool="echo",
                effect="read",
                idempotency_key=idempotency_key(SID, tid, 0, i),
            )
            for i in range(calls)
        ],
    )


async def _record(d: Delivery, tid: str, i: int, state: CallState) -> None:
    key = call_key(SID, tid, 0, i)
    outcome = CallOutcome(state=state, result={"n": i}) if state == CallState.SUCCEEDED else None
    rec = CallRecord(key=key, tool="echo", effect="read", state=state, outcome=outcome)
    await d.rt.state.write(call_state_key(key), rec, None)


async def test_the_users_message_is_restored_for_model_step_0(
    delivery: Delivery, nats_ready: EmbeddedServer
) -> None:
    turn = _turn("t-user", 0, 0)
    history = await _with_its_inputs(delivery.rt, turn, [])
    [entry] = [e for e in history if e.turn_id == "t-user"]
    assert entry.key == f"{SID}.t-user.user"
    assert entry.text == "hello there"


async def test_the_previous_steps_results_are_restored_from_the_call_records(
    delivery: Delivery, nats_ready: EmbeddedServer
) -> None:
    turn = _turn("t-results", 1, 2)
    await delivery.rt.state.write(turn_key(SID, "t-results"), turn, None)
    await _record(delivery, "t-results", 0, CallState.SUCCEEDED)
    await _record(delivery, "t-results", 1, CallState.SUCCEEDED)
    history = await _with_its_inputs(delivery.rt, turn, [])
    mine = [e for e in history if e.turn_id == "t-results"]
    assert [e.key for e in mine] == [
        f"{SID}.t-results.m0.c0.result",
        f"{SID}.t-results.m0.c1.result",
    ]
    assert [e.result for e in mine] == [{"n": 0}, {"n": 1}]


async def test_a_step_whose_results_are_not_all_recorded_waits(
    delivery: Delivery, nats_ready: EmbeddedServer
) -> None:
    turn = _turn("t-open", 1, 2)
    await delivery.rt.state.write(turn_key(SID, "t-open"), turn, None)
    await _record(delivery, "t-open", 0, CallState.SUCCEEDED)
    await _record(delivery, "t-open", 1, CallState.RUNNING)
    with pytest.raises(RetryLater):
        await _with_its_inputs(delivery.rt, turn, [])


async def test_nothing_is_read_or_sent_when_the_entries_are_in(
    delivery: Delivery, nats_ready: EmbeddedServer
) -> None:
    turn = _turn("t-in", 0, 0)
    first = await _with_its_inputs(delivery.rt, turn, [])
    assert await _with_its_inputs(delivery.rt, turn, first) is first


async def test_an_attempt_whose_history_cannot_be_had_after_its_claim_is_handed_back(
    delivery: Delivery, nats_ready: EmbeddedServer
) -> None:
    rt = delivery.rt
    turn = _turn("t-late", 1, 2)
    rev = await rt.state.write(turn_key(SID, "t-late"), turn, None)
    session = SessionRecord(session_id=SID, agent="tester", active="t-late")
    session_rev = await rt.state.write(session_key(SID), session, None)
    await _record(delivery, "t-late", 0, CallState.SUCCEEDED)
    await _record(delivery, "t-late", 1, CallState.RUNNING)  # its result is not in yet
    history: asyncio.Future[list[HistoryEntry]] = asyncio.ensure_future(rt.history.read(SID))
    step = StepMessage(
        kind=StepKind.RUN_MODEL, agent="tester", session_id=SID, turn_id="t-late", model_step=1
    )
    with pytest.raises(RetryLater, match="not all recorded"):
        await _model_step(
            delivery,
            step,
            Versioned(turn, rev),
            Versioned(session, session_rev),
            history,
            hinted=True,
        )
    now = await rt.state.turn(SID, "t-late")
    assert now is not None
    writes = await rt.state.kv.history(turn_key(SID, "t-late"))
    assert len(writes) == 3, "the record, the claim, the attempt handed back"
    assert now.value.attempt is None, "the attempt was handed back"
    assert now.value.attempts == 0, "and not counted"
    assert now.value.status == TurnStatus.RUNNING
