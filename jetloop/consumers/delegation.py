"""Delegation: a call hands a task to another agent as a child session, and waits.

The child session id and the child's request id derive from the parent call, so asking
again (a redelivery, a resume after a crash) finds the same child turn — and its answer —
instead of starting a second one. The parent call waits in state (``awaiting_child``),
holding nothing; the child's end wakes it (``finished`` followers of the child turn).
"""

from __future__ import annotations

import time

import structlog

from jetloop.agents.tools import DelegateArgs
from jetloop.consumers.calls import TOOL_CALL_NOT_RUN_ERROR_PREFIX, CallEnv, settle, write
from jetloop.consumers.tracing import wait_ended
from jetloop.schemas import (
    CallOutcome,
    CallState,
    Event,
    ParentCall,
    TurnRequest,
    TurnStatus,
    encode,
    scoped_msg_id,
    turn_id_for,
)
from jetloop.schemas.events import DelegationStartedData
from jetloop.schemas.ids import _digest
from jetloop.streams.bus import event_out, headers
from jetloop.streams.topology import turn_subject

log = structlog.get_logger("jetloop.delegation")


def child_session(call_key: str) -> str:
    return "d-" + _digest("delegation", call_key)


def child_request(call_key: str) -> str:
    return f"delegation.{call_key}"


async def _ask_child(env: CallEnv, args: DelegateArgs) -> None:
    """Publish the child's turn request; its request id makes a repeat a no-op."""
    sid = child_session(env.ckey)
    rid = child_request(env.ckey)
    parent = ParentCall(
        agent=env.turn.agent,
        session_id=env.turn.session_id,
        turn_id=env.turn.turn_id,
        model_step=env.n,
        call_index=env.call.index,
    )
    body = TurnRequest(text=args.task, metadata={"parent": parent.model_dump()})
    # Scoped by the child session, as every turn request's message id (docs/protocol.md).
    hdrs = {**headers("turn.request", sid, None, scoped_msg_id(sid, rid)), "Jl-Request-Id": rid}
    await env.rt.js.publish(turn_subject(args.agent, sid), encode(body), headers=hdrs)


async def start(env: CallEnv) -> None:
    args = DelegateArgs.model_validate(env.call.args)
    if env.rt.app.agent(args.agent) is None:
        await settle(
            env,
            CallOutcome(
                state=CallState.FAILED,
                error=f"{TOOL_CALL_NOT_RUN_ERROR_PREFIX}: no agent {args.agent!r} to delegate to",
            ),
            "invalid",
        )
        return
    sid = child_session(env.ckey)
    env = await write(
        env, env.rec.model_copy(update={"state": CallState.AWAITING_CHILD, "child_session": sid})
    )
    await _ask_child(env, args)
    await env.rt.bus.publish(
        [
            event_out(
                Event.of(
                    DelegationStartedData(call_key=env.ckey, agent=args.agent, child_session=sid),
                    key=f"call.{env.ckey}.delegated",
                    session_id=env.turn.session_id,
                    turn_id=env.turn.turn_id,
                )
            )
        ]
    )
    log.info("delegation.started", child_session=sid, agent=args.agent)


async def child_ready(env: CallEnv) -> None:
    """Ask again by the delegation key: the child's answer if it has one, else wait."""
    sid = child_session(env.ckey)
    child = await env.rt.state.turn(sid, turn_id_for(sid, child_request(env.ckey)))
    if child is None or not child.value.status.terminal:
        # Not there yet (or a crash came between the mark and the request): ask again.
        await _ask_child(env, DelegateArgs.model_validate(env.call.args))
        return
    turn = child.value
    if turn.status == TurnStatus.COMPLETED:
        text = turn.answer_text
        if turn.answer_ref is not None:
            text = (await env.rt.blobs.get(turn.answer_ref)).decode()
        outcome = CallOutcome(
            state=CallState.SUCCEEDED, result={"answer": text, "session": sid, "turn": turn.turn_id}
        )
    else:
        outcome = CallOutcome(
            state=CallState.FAILED,
            error=f"the delegated turn {turn.status.value}: {turn.error}",
        )
    await settle(env, outcome, "delegated")
    wait_ended(
        env.rt.tracing,
        env.turn,
        env.n,
        env.call,
        "child",
        turn.first_attempt_at or time.time(),
        {"jetloop.child_session": sid, "jetloop.child_turn": turn.turn_id},
    )
