"""The join: when every call of a model step has its outcome, the turn moves to the next step.

Each call's completion publishes its own join message (keyed by the call), so whichever
arrives after the last outcome moves the turn on; the others find it moved and stop. The
move is one CAS on the turn record from the revision read: two joins racing cannot both
win, and the loser looks again.
"""

from __future__ import annotations

import asyncio

from consumers.errors import DeadLetter, RetryLater
from consumers.followers import joined
from consumers.runtime import Delivery
from schemas import CallRecord, StepMessage, TurnPhase, call_key
from streams.state import Conflict, turn_key


async def _results(d: Delivery, sid: str, tid: str, n: int, count: int) -> list[CallRecord] | None:
    got = await asyncio.gather(*(d.rt.state.call(call_key(sid, tid, n, i)) for i in range(count)))
    if any(v is None or not v.value.done for v in got):
        return None
    return [v.value for v in got if v is not None]


async def on_join(d: Delivery, step: StepMessage) -> None:
    rt = d.rt
    sid, tid, n = step.session_id, step.turn_id, step.model_step
    cur = await rt.state.turn(sid, tid)
    if cur is None:
        raise DeadLetter(f"join for turn {tid} of session {sid}, which has no record")
    turn = cur.value
    if turn.status.terminal:
        return
    if turn.model_step == n + 1 and turn.phase == TurnPhase.MODEL:
        # Moved on already: make sure what follows the move went out.
        results = await _results(d, sid, tid, n, len(turn.calls))
        if results is not None:
            await joined(turn, results).publish(rt.bus)
        return
    if turn.model_step != n or turn.phase != TurnPhase.CALLS:
        return
    results = await _results(d, sid, tid, n, len(turn.calls))
    if results is None:
        return  # a later call's join will move the turn
    moved = turn.model_copy(
        update={
            "model_step": n + 1,
            "phase": TurnPhase.MODEL,
            "attempt": None,
            "attempts": 0,
            "first_attempt_at": None,
            "error": None,
            "answer_text": None,
            "answer_ref": None,
            "tool_calls_made": turn.tool_calls_made + len(results),
        }
    )
    try:
        await rt.state.write(turn_key(sid, tid), moved, cur.revision)
    except Conflict:
        raise RetryLater(0.02, "turn changed while joining") from None
    await joined(moved, results).publish(rt.bus)
