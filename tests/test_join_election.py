"""The join elects the call committed last: calls that finish together no longer race one
CAS on the turn, and no order of commits, reconciles and joins leaves a turn unmoved.

Real nats-server, real state store and bus; the records are written by hand so that each
order is exact, and ``join_calls`` runs as a call step runs it (its own index, first try).
"""

from __future__ import annotations

import asyncio
import contextlib

import nats
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from jetloop.consumers.join import join_calls
from jetloop.consumers.runtime import Delivery
from jetloop.schemas import (
    CallOutcome,
    CallRecord,
    CallState,
    PlannedCall,
    TurnPhase,
    TurnRecord,
    TurnStatus,
    call_key,
    idempotency_key,
)
from jetloop.services.embedded import EmbeddedServer
from jetloop.sessions.decisions import Control
from jetloop.streams.state import call_state_key, turn_key
from jetloop.streams.topology import STEPS_STREAM
from tests.test_heartbeat import delivery as delivery

SID = "elect"


def _turn(tid: str, calls: int) -> TurnRecord:
    return TurnRecord(
        session_id=SID,
        turn_id=tid,
        agent="tester",
        request_id=tid,
        text="go",
        status=TurnStatus.RUNNING,
        phase=TurnPhase.CALLS,
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


async def _done(d: Delivery, tid: str, i: int, state: CallState = CallState.SUCCEEDED) -> int:
    key = call_key(SID, tid, 0, i)
    rec = CallRecord(
        key=key,
        tool="echo",
        effect="read",
        state=state,
        attempts=1,
        outcome=CallOutcome(state=state, result={"i": i} if state == CallState.SUCCEEDED else None),
    )
    found = await d.rt.state.call(key)
    return await d.rt.state.write(call_state_key(key), rec, found.revision if found else None)


async def _step_of_turn(d: Delivery, tid: str) -> int:
    found = await d.rt.state.turn(SID, tid)
    assert found is not None
    return found.value.model_step


async def _next_model_step_published(d: Delivery, tid: str) -> bool:
    try:
        await d.rt.js.get_msg(STEPS_STREAM, subject=f"jl.step.model.tester.run_model.{SID}")
    except NotFoundError:
        return False
    return True


async def test_only_the_call_committed_last_moves_the_turn(
    delivery: Delivery,
    nats_ready: EmbeddedServer,
) -> None:
    d = delivery
    tid = "t-last"
    await d.rt.state.write(turn_key(SID, tid), _turn(tid, 3), None)
    for i in (2, 0, 1):  # committed in this order: call 1 last
        await _done(d, tid, i)
    # Every join finds all three outcomes in; the two not committed last stand aside.
    await join_calls(d, SID, tid, 0, first=True, own=2)
    await join_calls(d, SID, tid, 0, first=True, own=0)
    assert await _step_of_turn(d, tid) == 0
    await join_calls(d, SID, tid, 0, first=True, own=1)
    assert await _step_of_turn(d, tid) == 1
    assert await _next_model_step_published(d, tid)


async def test_a_redelivered_join_moves_the_turn_whoever_was_last(
    delivery: Delivery,
    nats_ready: EmbeddedServer,
) -> None:
    """The elected call's step died before its join: any redelivery joins unelected."""
    d = delivery
    tid = "t-redelivered"
    await d.rt.state.write(turn_key(SID, tid), _turn(tid, 2), None)
    await _done(d, tid, 0)
    await _done(d, tid, 1)
    await join_calls(d, SID, tid, 0, first=True, own=0)
    assert await _step_of_turn(d, tid) == 0
    await join_calls(d, SID, tid, 0, first=False, own=0)
    assert await _step_of_turn(d, tid) == 1


async def test_a_reconcile_after_the_last_commit_still_moves_the_turn(
    delivery: Delivery,
    nats_ready: EmbeddedServer,
) -> None:
    """Call 0's outcome is unknown; call 1 commits; a person reconciles call 0 before call
    1's join reads. Call 1's join is then not the last commit and stands aside; the join
    message the reconcile published moves the turn."""
    d = delivery
    tid = "t-reconciled"
    await d.rt.state.write(turn_key(SID, tid), _turn(tid, 2), None)
    await _done(d, tid, 0, CallState.OUTCOME_UNKNOWN)
    await _done(d, tid, 1)
    await Control(d.rt.state, d.rt.bus).reconcile(
        call_key(SID, tid, 0, 0), succeeded=True, by="ops", result={"ok": True}
    )
    await join_calls(d, SID, tid, 0, first=True, own=1)
    assert await _step_of_turn(d, tid) == 0
    join = await d.rt.js.get_msg(STEPS_STREAM, subject=f"jl.step.session.tester.join.{SID}")
    assert join.headers is not None
    assert join.headers["Nats-Msg-Id"] == f"{SID}.{tid}.m0.c0.join"
    # What on_join does with it on its first delivery: join, unelected.
    await join_calls(d, SID, tid, 0, first=True)
    assert await _step_of_turn(d, tid) == 1


async def test_joins_asked_together_read_once_and_one_moves_the_turn(
    delivery: Delivery,
    nats_ready: EmbeddedServer,
) -> None:
    """Five calls' joins in the same pass of the event loop (a model step's parallel calls,
    fetched and finished together) share one read of the turn and its calls; each sees every
    outcome, and only the one committed last moves the turn. A step view asked in the same
    pass shares it too, and a read asked after a write sees the write."""
    d = delivery
    tid = "t-shared"
    await d.rt.state.write(turn_key(SID, tid), _turn(tid, 5), None)
    for i in (4, 0, 3, 1, 2):  # committed in this order: call 2 last
        await _done(d, tid, i)
    reads: list[str] = []
    first = asyncio.Event()

    async def seen(msg: Msg) -> None:
        reads.append(msg.subject)
        first.set()

    watcher = await nats.connect(nats_ready.url)
    try:
        await watcher.subscribe("$JS.API.DIRECT.GET.KV_jl_state", cb=seen)
        await watcher.flush()
        view, *_ = await asyncio.gather(
            d.rt.state.step_view(SID, tid, call_key(SID, tid, 0, 2)),
            *(join_calls(d, SID, tid, 0, first=True, own=i) for i in range(5)),
        )
        await watcher.flush()
        # The watcher's callback runs when its loop gets to it (late on a loaded machine):
        # waited for, then a moment more for any other request that would have come.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(first.wait(), 5.0)
        await asyncio.sleep(0.2)
    finally:
        await watcher.close()
    assert len(reads) == 1, reads  # six reads asked together: one request
    turn, rec, _ = view
    assert turn is not None and rec is not None and rec.value.done
    assert await _step_of_turn(d, tid) == 1
    assert await _next_model_step_published(d, tid)
    moved = await d.rt.state.step_view(SID, tid, call_key(SID, tid, 0, 2))
    assert moved[0] is not None and moved[0].value.model_step == 1  # read after the write
