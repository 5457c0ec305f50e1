"""CallTool and CallSingleAttemptTool, and the waits of a call; the call's state decides.

The call record ``call.<sid>.<tid>.<step>.<index>`` is the one key a call step commits. Every
message that concerns a call (the call itself, an approval's or an answer's wake, a timer
firing, a poll) comes here; what happens is read from the record, never from the message:

    no record / claimed  → the approval gate, then by tool kind: run, ask, set a timer, start
    awaiting_approval    → the gate again: still pending → wait; approved → run; rejected → denied
    (any, tool gone)     → a deploy removed the tool or changed its arguments: ``without_tool``
    awaiting_answer      → answered → succeeded with the answer; else wait
    waiting_timer        → due → succeeded; else (re)arm the schedule
    task_running         → poll the task
    in_doubt, attempt    → a lost attempt: settle (docs/crash-resume.md, settlement table)

The claim of a write is its in-doubt mark, written just before the tool is made. A read on
its first delivery writes no claim: its outcome is the call's first record, a create (a read
delivered again claims, as ``running``, so that losing it is seen and counted). A lost CAS
anywhere is a takeover: nothing more is written, published or acked.
"""

from __future__ import annotations

import asyncio
import json
import time

import structlog
from pydantic import BaseModel, ValidationError

from jetloop.agents import Effect, Found, ToolKind
from jetloop.agents.mcp import MCPUnreachable
from jetloop.consumers import delegation, tasks, waits
from jetloop.consumers.approvals import Gate, denial, gate
from jetloop.consumers.calls import (
    NOT_SENT_AGAIN,
    TOOL_CALL_NOT_RUN_ERROR_PREFIX,
    CallEnv,
    ToolCtx,
    exhausted,
    new_record,
    settle,
    settle_record,
    succeeded,
    window_passed,
    write,
)
from jetloop.consumers.errors import DeadLetter, RetryLater, TakenOver
from jetloop.consumers.followers import call_done
from jetloop.consumers.join import StepCalls, join_calls, keep_reads, outcome_told_and_joined
from jetloop.consumers.liveness import Takeover, holder_lost
from jetloop.consumers.logcontext import bind_step
from jetloop.consumers.losses import record_loss, tell_resumed
from jetloop.consumers.runtime import Delivery
from jetloop.consumers.tracing import tool_span
from jetloop.schemas import (
    CallOutcome,
    CallRecord,
    CallState,
    Decision,
    StepMessage,
    StepReads,
    TurnPhase,
    call_key,
)
from jetloop.schemas.errors import RetryableToolError, ToolError
from jetloop.schemas.kinds import CALLS_PER_MESSAGE
from jetloop.streams.state import Conflict, StateStore, call_state_key, step_reads_key

log = structlog.get_logger("jetloop.call_tool")

__all__ = ["TOOL_CALL_NOT_RUN_ERROR_PREFIX", "on_call", "on_calls"]

# The states an attempt holds a call in while it runs the tool: found by another delivery,
# the attempt is lost once its holder is (jetloop.consumers.liveness).
LOSABLE = (CallState.IN_DOUBT, CallState.RUNNING)


async def on_call(d: Delivery, step: StepMessage) -> None:
    rt = d.rt
    sid, tid, n = step.session_id, step.turn_id, step.model_step
    if step.call_index is None:
        raise DeadLetter(f"{step.kind.value} step without call_index")
    i = step.call_index
    ckey = call_key(sid, tid, n, i)
    bind_step(call=ckey)

    turn_v, rec_v, session_v = await rt.state.step_view(sid, tid, ckey)
    if turn_v is None:
        raise DeadLetter(f"{step.kind.value} for turn {tid} of session {sid}, which has no record")
    turn = turn_v.value
    if d.together is not None:
        d.together.saw(turn_v, session_v)
    current = turn.model_step == n and turn.phase == TurnPhase.CALLS and not turn.status.terminal
    if rec_v is not None and rec_v.value.done:
        # The outcome is committed; its worker may have died before what follows went out.
        # Sent again from state, under the same message ids (it lands once): the event
        # always, whatever the turn's state now (the audit stream and the read model need
        # every outcome); then the join, which moves the turn only while it is at this step
        # and publishes what follows again if it moved (the dead worker's move, maybe).
        if current or turn.model_step == n + 1:
            await outcome_told_and_joined(d, turn, rec_v.value, n, i, first=False)
        else:
            await call_done(turn, rec_v.value, folded=rt.folded_log).publish(rt.bus)
        return
    if not current:
        # The turn moved on, ended or was cancelled: nothing to make.
        log.info("call.stale_step", turn_step=turn.model_step, status=turn.status.value)
        return
    held = rec_v.value.attempt if rec_v is not None else None
    takeover = Takeover.LOST
    if held is not None and rec_v is not None and rec_v.value.state in LOSABLE:
        # Another attempt claimed it: settled here only once that attempt is lost.
        takeover = await holder_lost(d, call_state_key(ckey), held, rec_v.stored_at)
    if i >= len(turn.calls):
        raise DeadLetter(f"call index {i} is out of range for step {n} of turn {tid}")
    call = turn.calls[i]
    rec = rec_v.value if rec_v else new_record(ckey, call)

    agent = rt.app.agent(turn.agent)
    if agent is None and call.invalid is None:
        raise RetryLater(5.0, f"agent {turn.agent!r} is not served by this worker")
    try:
        # (An invalid call is settled without its tool: no MCP server is listed for it.)
        tool = await agent.find_tool(call.tool) if agent and call.invalid is None else None
    except MCPUnreachable as exc:
        # An MCP server this worker never listed cannot be reached: nothing was sent.
        raise RetryLater(5.0, str(exc)) from exc
    if agent is None or tool is None or call.invalid is not None:
        # Gates as they stand now: a tool the agent no longer offers (a deploy removed or
        # renamed it) is not made (docs/design.md, "Deploying new agent code").
        why = call.invalid or (
            f"the agent no longer offers the tool {call.tool!r} (removed or renamed since "
            "the call was asked for)"
        )
        outcome, settlement = await without_tool(rt.state, turn.session_id, rec, why)
        await settle_record(
            d, turn, n, call.index, rec, rec_v.revision if rec_v else None, outcome, settlement
        )
        return
    if tool.elsewhere:
        # Declared here, made by the workers of its pool: this one reached a worker that has
        # the declaration only (started with ``--pools <pool>`` beside the wrong app, or the
        # call was planned before a deploy moved the tool). Left for a worker that has it.
        raise RetryLater(
            5.0,
            f"the tool {call.tool!r} is made by the workers of pool {tool.pool!r}; this "
            "worker has its declaration only",
        )
    env = CallEnv(
        d,
        turn,
        n,
        call,
        ckey,
        rec,
        rec_v.revision if rec_v else None,
        agent,
        tool,
        session_v.value if session_v else None,
        takeover,
    )
    d.watch_turn = (sid, tid)

    match rec.state:
        case CallState.TASK_RUNNING:
            if tool.poll is None:
                # A deploy made the task tool a plain call: the task started may still run.
                outcome = CallOutcome(
                    state=CallState.OUTCOME_UNKNOWN,
                    error=f"{TASK_NOT_POLLED}: the tool {call.tool!r} is no longer a task",
                )
                await settle(env, outcome, "gate")
                return
            await tasks.poll(env)
            return
        case CallState.WAITING_TIMER:
            await waits.timer_due(env)
            return
        case CallState.AWAITING_ANSWER:
            await waits.answer_ready(env)
            return
        case CallState.AWAITING_CHILD:
            await delegation.child_ready(env)
            return

    try:
        env.tool_args()
    except ValidationError as exc:
        # A deploy changed the tool's arguments since the model asked for the call.
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "arguments"
        why = f"its arguments no longer fit the tool {call.tool!r} ({where}: {first['msg']})"
        outcome, settlement = await without_tool(rt.state, sid, rec, why)
        await settle(env, outcome, settlement)
        return
    passed = await gate(env)
    if passed is Gate.WAIT or passed is Gate.DONE:
        return
    env = passed  # the gate may have written the record (an approval was read)

    match tool.kind:
        case ToolKind.QUESTION:
            await waits.ask(env)
        case ToolKind.TIMER:
            await waits.set_timer(env)
        case ToolKind.DELEGATE:
            await delegation.start(env)
        case ToolKind.CALL | ToolKind.TASK:
            await run(env)


async def on_calls(d: Delivery, step: StepMessage) -> None:
    """Every call a model step asked for, from one message: each handled as ``on_call``
    handles a call's own message, side by side, each fenced on its own (``Delivery.part``)
    and joining as it would alone (the call committed last moves the turn), except that a
    message carrying every call of its step joins once, from what its parts know, without
    reading the outcomes back (``consumers.join.StepCalls``).

    The message is settled once for all: acked when every call ended its part (an outcome
    committed, or a wait begun); not acked when a call was taken over (the message is another
    attempt's now); handed back when one must wait (the calls that ended find their outcomes
    committed when it comes back, tell them again and join, as a redelivered call does)."""
    count = step.calls
    if count is None or not 0 < count <= CALLS_PER_MESSAGE:
        raise DeadLetter(
            f"{step.kind.value} step with {count} calls (1 to {CALLS_PER_MESSAGE} are sent)"
        )
    slots = d.rt.call_slots
    # The tool pool's concurrency counts calls, not messages: the calls take their slots
    # together, so they start (and read) together (``jetloop.consumers.slots``); each gives
    # its own back when it ends. ``held[i]``: call i holds a slot now.
    held = [False] * count

    def give_back(i: int) -> None:
        if slots is not None and held[i]:
            held[i] = False
            slots.release()

    async def one(part: Delivery, i: int) -> None:
        own = step.model_copy(update={"call_index": i, "calls": None})
        try:
            if slots is not None and not held[i]:
                await slots.one()  # a message of more calls than the pool has slots
                held[i] = True
            await on_call(part, own)
        finally:
            give_back(i)
            part.end_part()

    parts = [d.part() for _ in range(count)]
    known = StepCalls(parts)
    for part in parts:
        part.together = known
    slotted = await slots.take(count) if slots is not None else 0
    held[:slotted] = [True] * slotted
    try:
        got = await asyncio.gather(
            *(one(part, i) for i, part in enumerate(parts)), return_exceptions=True
        )
    finally:
        for i in range(count):
            give_back(i)  # (the slot of a call that never started)
    errors = [e for e in got if isinstance(e, BaseException)]
    lost = next((p for p in parts if p.lost), None)
    taken = next((e for e in errors if isinstance(e, TakenOver)), None)
    if lost is not None or taken is not None:
        d.lost = True  # nothing more is sent for the message: not even a nak
        raise taken or TakenOver((lost.fence_key if lost is not None else None) or "?")
    if known.unrecorded and all(isinstance(e, RetryLater) for e in errors):
        # Reads whose outcome waited for the step's last: it did not come in this message (a
        # sibling began a wait, or must be tried again). Kept now, before the message is
        # settled, and joined from state: the step may be complete by now.
        told = await keep_reads(d, known)
        await told.publish(d.rt.bus)
        await join_calls(d, step.session_id, step.turn_id, step.model_step, first=True)
    waits: list[RetryLater] = []
    for e in errors:
        if not isinstance(e, RetryLater):
            raise e  # a failure no wait cures, or a shutdown: the message is settled for it
        waits.append(e)
    if waits:
        raise min(waits, key=lambda e: e.delay)  # handed back once, for the call due first


# What a call that may have started something at a vendor is told when it cannot be followed.
TASK_NOT_POLLED = "the task it started may still be running, and cannot be polled"
CHILD_NOT_AWAITED = "the sub-agent it asked may still be answering, and is not awaited"


async def without_tool(
    state: StateStore, session_id: str, rec: CallRecord, why: str
) -> tuple[CallOutcome, str]:
    """The outcome (and settlement) of a call whose tool cannot be made as asked: invalid,
    no longer offered, or its arguments no longer fit (docs/design.md, "Deploying new agent
    code"). What may have run or be running is unknown, never "safe to call again"; a
    person's decision on its approval is kept; the rest did not run."""
    match rec.state:
        case CallState.IN_DOUBT if rec.attempt is not None:
            return CallOutcome(
                state=CallState.OUTCOME_UNKNOWN, error=f"{NOT_SENT_AGAIN}; {why}"
            ), "gate"
        case CallState.TASK_RUNNING:
            return CallOutcome(
                state=CallState.OUTCOME_UNKNOWN, error=f"{TASK_NOT_POLLED}: {why}"
            ), "gate"
        case CallState.AWAITING_CHILD:
            return CallOutcome(
                state=CallState.OUTCOME_UNKNOWN, error=f"{CHILD_NOT_AWAITED}: {why}"
            ), "gate"
        case CallState.AWAITING_APPROVAL if rec.approval_id is not None:
            found = await state.approval(session_id, rec.approval_id)
            if found is not None and found.value.status == Decision.REJECTED:
                return denial(found.value), "denied"
            if found is not None and found.value.status == Decision.APPROVED:
                why = f"approved by {found.value.decided_by or 'a person'}, but {why}"
    return CallOutcome(
        state=CallState.FAILED, error=f"{TOOL_CALL_NOT_RUN_ERROR_PREFIX}: {why}"
    ), "gate"


async def run(env: CallEnv) -> None:
    """Make the call (or start the task) at most as often as its effect class allows."""
    rt, rec, tool = env.rt, env.rec, env.tool
    # A call once marked as a write stays a write: the checkpointed effect decides.
    effect = Effect(env.call.effect)
    args = env.tool_args()

    # An attempt of this process that never began its call (``Unstarted``): continued under
    # its number, its mark true of nothing made yet, so neither lost nor settled in doubt.
    # (on_call found it held by no delivery here: ``Takeover.ABANDONED``.)
    again = (
        rec.attempt is not None
        and rec.state in LOSABLE
        and env.takeover == Takeover.ABANDONED
        and rt.took_unstarted(env.skey, rec.attempt)
    )
    if again:
        log.info("call.attempt_continued", attempt=rec.attempts)  # the attempt's number
    elif rec.attempt is not None and rec.state in LOSABLE:
        # An attempt was lost (its holder is gone, on_call checked): a takeover of the turn,
        # counted once.
        lost = rec.attempt
        step_key = f"{env.turn.session_id}.{env.turn.turn_id}.m{env.n}.c{env.call.index}"
        resume = await record_loss(
            rt, env.turn.session_id, env.turn.turn_id, step_key, lost, env.takeover
        )
        if resume is None:
            return  # one loss too many: the turn failed, close_turn settles this call
        how = await _resume_settlement(env, effect, args)
        await tell_resumed(rt, env.turn, step_key, lost, resume, {env.ckey: how})
        if how != "made again":
            return

    unclaimed = effect == Effect.READ and tool.kind == ToolKind.CALL and env.rev is None
    if unclaimed and not env.d.first_sight:
        # Delivered before (or a rescuer's copy, or stored before this process's link opened:
        # a restarted server's redelivery counted 1), with nothing in state: that delivery may
        # have made the read unclaimed and died. Counted as an attempt (a read has at most
        # ``max_attempts``, lost ones included); this one claims, so losing it is seen and
        # charged like any claimed attempt's loss.
        unclaimed = False
        rec = rec.model_copy(update={"attempts": max(rec.attempts, 1)})
        log.info("call.read_delivered_again", delivery=env.d.num_delivered)
        kept = await _reads_fenced(env)
        if kept is not None:
            # That delivery kept the read's outcome with the step's other reads: done.
            await outcome_told_and_joined(env.d, env.turn, kept, env.n, env.call.index, False)
            return

    used = rec.attempts - 1 if again else rec.attempts
    if used >= tool.max_attempts or window_passed(rec, tool):
        await settle(env, exhausted(rec, effect.is_write), "attempts_exhausted")
        return

    await rt.faults.point("call_tool.before_mark")
    attempt = rt.new_attempt(used + 1)
    marked = rec.model_copy(
        update={
            "state": CallState.IN_DOUBT if effect.is_write else CallState.RUNNING,
            "attempt": attempt,
            "attempts": attempt.no,
            "marked": rec.marked + (1 if effect.is_write and not again else 0),
            "first_attempt_at": rec.first_attempt_at or attempt.started_at,
        }
    )
    if not unclaimed:
        rt.unstarted.claiming(env.skey, attempt.no)
    if unclaimed:
        # A read on its first delivery runs without a claim: its one write is the outcome,
        # a create, which fails if another attempt claimed the call meanwhile (a takeover:
        # nothing is published or acked). Running twice is what a read may do.
        env = env.with_rec(marked, None)
    else:
        env = await write(env, marked)
    bind_step(attempt=attempt.no)

    await rt.faults.point("call_tool.in_tool")
    if not await env.d.still_ours(fresh_for=rt.lease_seconds / 4):
        # Stalled past the lease between the mark and the call: another attempt owns it.
        raise TakenOver(env.skey)
    ctx = ToolCtx(env.d, env.turn, env.n, env.call, attempt.no)
    rt.unstarted.began(env.skey, attempt.no)
    try:
        with tool_span(rt.tracing, env.turn, env.n, env.call, attempt.no):
            result = await tool.fn(args, ctx)
    except ToolError as exc:
        outcome = CallOutcome(state=CallState.FAILED, error=str(exc))
    except Exception as exc:
        retryable = isinstance(exc, RetryableToolError) or effect != Effect.NON_IDEMPOTENT_WRITE
        if retryable and attempt.no < tool.max_attempts:
            # The attempt ended with a known failure (it was not lost): say so in state, so
            # the next attempt makes the call again instead of settling it.
            log.warning("tool.failed", error=str(exc), will_retry=True)
            await write(env, marked.model_copy(update={"attempt": None}))
            raise RetryLater(min(30.0, 0.5 * 2 ** (attempt.no - 1)), str(exc)) from exc
        log.warning("tool.failed", error=str(exc), will_retry=False)
        state = CallState.OUTCOME_UNKNOWN if effect.is_write else CallState.FAILED
        error = f"{type(exc).__name__}: {exc}"
        if retryable:
            error = f"every attempt ({attempt.no}) failed; the last with {error}"
        outcome = CallOutcome(state=state, error=error)
    else:
        if tool.kind == ToolKind.TASK:
            await rt.faults.point("call_tool.before_commit")
            await tasks.started(env, result)
            return
        outcome = await succeeded(rt, env.ckey, attempt.no, result)

    await rt.faults.point("call_tool.before_commit")
    done = env.rec.model_copy(update={"state": outcome.state, "outcome": outcome, "attempt": None})
    if unclaimed and _kept_with_reads(env, outcome):
        # Its outcome goes into one record with the step's other reads (``StepReads``),
        # written when the last of them ends or when the message's parts have all ended.
        log.debug("call.kept_with_reads", state=outcome.state.value)
        await outcome_told_and_joined(env.d, env.turn, done, env.n, env.call.index, recorded=False)
        return
    env = await write(env, done)
    log.debug("call.recorded", state=outcome.state.value, attempts=attempt.no)
    await rt.faults.point("call_tool.after_commit")
    await outcome_told_and_joined(env.d, env.turn, done, env.n, env.call.index)


def _kept_with_reads(env: CallEnv, outcome: CallOutcome) -> bool:
    """Whether a read that ran unclaimed keeps its outcome with its step's other reads: in a
    message that carries every call of the step, while every live worker reads such a record
    (``Runtime.step_reads``), and when the outcome is small and the record stays well
    within a message's limit (``StepCalls.keeps``)."""
    known = env.d.together
    if not env.rt.step_reads or known is None or not known.carries_every_call(env.turn):
        return False
    size = outcome_bytes(outcome)
    return size is not None and known.keeps(size, env.rt.nc.max_payload)


def outcome_bytes(outcome: CallOutcome) -> int | None:
    """What an outcome weighs in a record, about (its result as JSON, or the reference to
    its blob, and its error); None for a result that is not JSON."""
    size = len((outcome.error or "").encode())
    if outcome.result_ref is not None:
        return size + len(outcome.result_ref.model_dump_json())
    try:
        return size + len(json.dumps(outcome.result))
    except (TypeError, ValueError):
        return None


async def _reads_fenced(env: CallEnv) -> CallRecord | None:
    """A read delivered again with no record of its own: its step's reads record is written
    first (empty) if there is none, so that an earlier delivery of the message still making
    its reads can no longer keep them together (that write is a create: it fails, a
    takeover, and that delivery writes nothing). If the earlier delivery kept them first,
    this call's outcome is there: returned, and the read is not made again."""
    t = env.turn
    key = step_reads_key(t.session_id, t.turn_id, env.n)
    try:
        await env.rt.state.write(key, StepReads(calls=[]), None)
        return None
    except Conflict:
        found = await env.rt.state.call(env.ckey)
        return found.value if found is not None and found.value.done else None


async def _resume_settlement(env: CallEnv, effect: Effect, args: BaseModel) -> str:
    """Settle a call whose attempt was lost (docs/crash-resume.md, "Settlement of a call in
    doubt"); returns how, or "made again" when the call is to be made again now."""
    tool, rec = env.tool, env.rec
    if rec.state == CallState.RUNNING or effect == Effect.READ:
        return "made again"
    window = tool.dedupe_window_seconds
    past_window = (
        effect == Effect.IDEMPOTENT_WRITE
        and window is not None
        and rec.first_attempt_at is not None
        and time.time() - rec.first_attempt_at > window
    )
    if effect == Effect.IDEMPOTENT_WRITE and not past_window:
        log.info("call.resume", settlement="made again with the same idempotency key")
        return "made again"
    # A single-attempt write, or a keyed write whose vendor has forgotten the key by now.
    if tool.reader is not None:
        back = await tool.reader(args, ToolCtx(env.d, env.turn, env.n, env.call, rec.attempts))
        if isinstance(back, Found):
            outcome = await succeeded(env.rt, env.ckey, rec.attempts, back.result)
            await settle(env, outcome, "read_back")
            return "read back"
        log.info("call.resume", settlement="read back: not applied, made again")
        return "made again"
    error = NOT_SENT_AGAIN
    if past_window:
        error += f" (its vendor dedupes the key only for {window:g}s, which has passed)"
    await settle(env, CallOutcome(state=CallState.OUTCOME_UNKNOWN, error=error), "outcome_unknown")
    return "outcome_unknown"
