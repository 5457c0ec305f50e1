"""RunModel: ask the model for the next step of a turn, and commit its answer ahead of work.

Rules kept: state first (a step already answered is never asked again, only re-emitted);
claim then work then commit with CAS (a lost CAS is a takeover: nothing more is written,
published or acked); nothing is paid for after a takeover (the fence is checked right before
the model call, and a heartbeat that finds it lost cancels the call in flight); write ahead
(the answer and every call it plans are committed before any call is made); commit,
publish, ack.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import structlog
from pydantic import ValidationError

from jetloop.agents import Agent, Message, ModelRequest, ModelResponse, Tool, ToolSpec
from jetloop.agents.adapters import MalformedToolCall
from jetloop.agents.mcp import MCPUnreachable
from jetloop.agents.tools import DEFAULT_TOOL_POOL
from jetloop.consumers import flow, metrics
from jetloop.consumers.budgets import over_budget
from jetloop.consumers.carry import trusted_carry
from jetloop.consumers.compact import compact_first, compaction_needed, estimate
from jetloop.consumers.conversation import conversation
from jetloop.consumers.errors import DeadLetter, RetryLater, StaleCarry, TakenOver
from jetloop.consumers.followers import (
    Followers,
    accepted_event,
    answer,
    expected_history,
    results_again,
    turn_start,
)
from jetloop.consumers.liveness import holder_lost, own_unstarted
from jetloop.consumers.logcontext import bind_step
from jetloop.consumers.losses import (
    Resume,
    loss_id,
    lost_event,
    lost_reason,
    not_a_loss,
    tell_resumed,
)
from jetloop.consumers.runtime import Delivery, Runtime
from jetloop.consumers.session import end_turn
from jetloop.consumers.side_by_side import side_by_side
from jetloop.consumers.tracing import answered, model_span
from jetloop.consumers.usage import (
    lost_call,
    model_of,
    record_usage,
    usage_again,
    usage_event,
)
from jetloop.schemas import (
    Carried,
    HistoryEntry,
    PlannedCall,
    SessionRecord,
    Spent,
    StepMessage,
    TurnPhase,
    TurnRecord,
    TurnStatus,
    idempotency_key,
)
from jetloop.schemas.errors import ProviderError, ProviderRejected, ProviderRetryable
from jetloop.schemas.events import ModelUsageData
from jetloop.schemas.ids import call_id
from jetloop.streams.bus import event_out
from jetloop.streams.state import Versioned, turn_key
from jetloop.streams.topology import live_subject

log = structlog.get_logger("jetloop.run_model")


async def on_run_model(d: Delivery, step: StepMessage) -> None:
    carried = trusted_carry(d, step.carried)
    if carried is not None and carried.turn.attempt is None:
        try:
            await _run_model(d, step, carried)
            return
        except StaleCarry as exc:
            log.info("run_model.carried_stale", key=exc.key)
            now = await d.rt.state.turn(step.session_id, step.turn_id)
            if now is not None and now.value.attempt is not None:
                # Claimed since the message was published (another delivery of it, or another
                # message of the step): the claim this one lost was a race, as when a claim
                # from a read loses: nothing more is sent on the message.
                raise TakenOver(exc.key) from None
    await _run_model(d, step, None)


async def _run_model(d: Delivery, step: StepMessage, carried: Carried | None) -> None:
    """The step, from the records its message carried (checked by the claim's CAS: a record
    written since is ``StaleCarry``, before anything is written) or from what it reads."""
    rt = d.rt
    sid, tid = step.session_id, step.turn_id
    cur: Versioned[TurnRecord] | None
    session: Versioned[SessionRecord] | None
    history: asyncio.Future[list[HistoryEntry]]
    if carried is not None:
        # Nothing to read before deciding: the history is on its way while the step decides
        # and claims, and is taken where it is first needed (``_model_step``).
        history = asyncio.ensure_future(rt.history.read(sid))
        cur = Versioned(carried.turn, carried.turn_revision)
        session = Versioned(carried.session, carried.session_revision)
    else:
        # The session's history is read with the turn, not after it: one round trip less
        # on every model step (a step that turns out to have nothing to do wasted one
        # read). The entries it needs are checked below (``_with_its_inputs``).
        read, (cur, session) = await side_by_side(
            rt.history.read(sid), rt.state.turn_view(sid, tid)
        )
        history = asyncio.get_running_loop().create_future()
        history.set_result(read)
    try:
        await _model_step(d, step, cur, session, history, hinted=carried is not None)
    finally:
        if not history.done():
            history.cancel()  # not needed after all (the step ended, or was taken over)
        history.add_done_callback(_settled)


def _unused(claimed: TurnRecord, used: int) -> TurnRecord:
    """The claimed turn handed back, its attempt not used: none held, none counted."""
    return claimed.model_copy(update={"attempt": None, "attempts": used})


def _settled(read: asyncio.Future[list[HistoryEntry]]) -> None:
    """A read nobody took: its failure is not news (the step ended without it)."""
    if not read.cancelled():
        read.exception()


async def _model_step(
    d: Delivery,
    step: StepMessage,
    cur: Versioned[TurnRecord] | None,
    session: Versioned[SessionRecord] | None,
    history: asyncio.Future[list[HistoryEntry]],
    *,
    hinted: bool,
) -> None:
    """``history``: the session's history, read or on its way. When nothing before the claim
    needs it (no context budget, no spending budget), it is taken after the claim, so that
    its read and the claim's write overlap; an attempt whose read then fails is handed back
    unused, as one that finds no free slot of the model endpoint is."""
    rt = d.rt
    sid, tid, n = step.session_id, step.turn_id, step.model_step
    if cur is None:
        raise DeadLetter(f"run_model for turn {tid} of session {sid}, which has no record")
    turn = cur.value
    if turn.status.terminal:
        if turn.model_step == n and turn.status == TurnStatus.COMPLETED:
            await rt.bus.publish(usage_again(rt, turn))  # its answer ended the turn
        await end_turn(rt, turn)
        return
    if turn.model_step > n:
        return
    if turn.model_step == n and turn.phase == TurnPhase.CALLS:
        # The usage told again goes out with the answer's records, before its calls.
        told = Followers(usage_again(rt, turn))
        await (told + answer(turn, rt.calls_in_one_message, folded=rt.folded_log)).publish(rt.bus)
        return
    if turn.model_step < n:
        raise DeadLetter(f"run_model for step {n} but turn {tid} is at step {turn.model_step}")

    agent = rt.app.agent(turn.agent)
    if agent is None:
        raise RetryLater(5.0, f"agent {turn.agent!r} is not served by this worker")

    limits = agent.limits
    # Whether the conversation is needed before the claim (for a budget), or after it.
    budgeted = limits.turn_budget is not None or limits.session_budget is not None
    late = hinted and not (limits.context_budget_tokens or budgeted)
    if not late:
        read = await _with_its_inputs(rt, turn, await history)
    now = time.time()
    resumed = turn.attempt
    lost = list(turn.lost)
    stopped = False  # the lost attempt's worker stopped on purpose (jetloop.consumers.losses)
    abandoned = False  # the lost attempt's worker lives and had stopped working on it
    spent = turn.spent
    # An attempt of this process that never called the model is continued, not counted: its
    # claim landed though its delivery ended before the call (``Unstarted``).
    again = resumed is not None and await own_unstarted(d, turn_key(sid, tid), resumed)
    if again:
        log.info("model.attempt_continued", attempt=turn.attempts)
        resumed = None
    if resumed is not None:
        # Another attempt claimed this step: taken over only once that attempt is lost.
        why = await holder_lost(d, turn_key(sid, tid), resumed, cur.stored_at)
        metrics.TAKEOVERS.inc()
        # Its call was paid for if it got an answer: the turn's count takes it in.
        paid = await lost_call(rt.js, sid, tid, n, resumed.no)
        if paid is not None:
            spent = spent.plus(paid.input_tokens, paid.output_tokens, paid.cost_usd)
        # The attempt before this one was lost (its lease lapsed): a takeover of the turn,
        # unless its holder lives and had stopped working on it (abandoned) or had stopped
        # on purpose (drained).
        stopped, abandoned = await not_a_loss(rt, resumed, why)
        lid = loss_id(resumed)
        if lid not in lost and not stopped and not abandoned:
            lost.append(lid)
        if len(lost) > rt.max_losses:
            gone = turn.model_copy(
                update={
                    "status": TurnStatus.FAILED,
                    "attempt": None,
                    "lost": lost,
                    "spent": spent,
                    "error": lost_reason(turn, len(lost), step.step_key()),
                }
            )
            await d.claim(turn_key(sid, tid), gone, cur.revision, hinted)
            await rt.bus.publish([event_out(lost_event(turn, len(lost), step.step_key()))])
            await end_turn(rt, gone)
            return

    used = turn.attempts - 1 if again else turn.attempts
    exhausted = used >= limits.model_attempts or (
        turn.first_attempt_at is not None
        and now - turn.first_attempt_at > limits.model_attempt_window_seconds
    )
    messages: list[Message] | None = None  # read once: for the budget, then for the model
    if not exhausted and n < limits.max_model_steps and limits.context_budget_tokens:
        messages = await conversation(rt, sid, session=session, history=read)
        if await compaction_needed(rt, agent, turn, messages, session):
            await compact_first(rt, turn)
            return

    tools = agent.tools
    reason = None
    if exhausted:
        reason = _exhausted(n, turn.model_copy(update={"attempts": used}))
    elif n >= limits.max_model_steps:
        reason = f"the turn reached its limit of {limits.max_model_steps} model steps"
    else:
        if messages is None and not late:
            # Read before the claim: a read that fails (an election) then leaves no claimed
            # attempt behind, which the next delivery would have to count as lost.
            messages = await conversation(rt, sid, session=session, history=read)
        try:
            # Listed before the claim too: the MCP servers' tools as they are now.
            tools = await agent.list_tools()
        except MCPUnreachable as exc:
            raise RetryLater(5.0, str(exc)) from exc
        if budgeted:
            assert messages is not None  # read before the claim: ``late`` is False
            reads = estimate(agent, messages)
            reason = over_budget(
                limits,
                spent,
                session.value.spent if session is not None else Spent(),
                reads,
                rt.prices.cost(model_of(agent.model), {"input_tokens": reads}),
            )
    if reason is not None:
        failed = turn.model_copy(
            update={
                "status": TurnStatus.FAILED,
                "error": reason,
                "attempt": None,
                "lost": lost,
                "spent": spent,
            }
        )
        await d.claim(turn_key(sid, tid), failed, cur.revision, hinted)
        await end_turn(rt, failed)
        return
    # A provider's pause and the endpoint's window, before the claim: no attempt is used.
    admission = await flow.admit(rt, agent.model)
    try:
        attempt = rt.new_attempt(used + 1)
        claimed = turn.model_copy(
            update={
                "status": TurnStatus.RUNNING,
                "attempt": attempt,
                "attempts": attempt.no,
                "first_attempt_at": turn.first_attempt_at or now,
                "lost": lost,
                "spent": spent,
            }
        )
        rt.unstarted.claiming(turn_key(sid, tid), attempt.no)
        await d.claim(turn_key(sid, tid), claimed, cur.revision, hinted)
        bind_step(attempt=attempt.no)
        holder = {"session": sid, "turn": tid, "incarnation": rt.incarnation, "no": attempt.no}
        if not await admission.take_slot(holder):
            # Every call the endpoint may have in flight is: hand the step back, its attempt
            # not used.
            await d.commit(_unused(claimed, used))
            raise RetryLater(0.25, "every slot of the model endpoint is in use")
        if messages is None:
            try:
                read = await _with_its_inputs(rt, turn, await history)
                messages = await conversation(rt, sid, session=session, history=read)
            except Exception:
                # No model call was made: the attempt is handed back unused (a failure of
                # this write, such as a takeover, is what the step then ends with).
                await d.commit(_unused(claimed, used))
                raise
        if resumed is not None:
            await tell_resumed(
                rt, turn, step.step_key(), resumed, Resume(len(lost), stopped, abandoned), {}
            )

        request = ModelRequest(
            agent=agent.name,
            instructions=agent.instructions,
            messages=messages,
            tools=[ToolSpec(t.name, t.description, t.json_schema()) for t in tools],
            attempt=attempt.no,
            session_id=sid,
            turn_id=tid,
            model_step=n,
        )
        await rt.faults.point("run_model.in_call")
        if not await d.still_ours(fresh_for=rt.lease_seconds / 4):
            # Stalled past the lease since the claim: another attempt owns the step, and a model
            # call now would be paid for and thrown away (or ask again what was answered).
            raise TakenOver(turn_key(sid, tid))
        log.debug("model.call", attempt=attempt.no)
        rt.unstarted.began(turn_key(sid, tid), attempt.no)
        try:
            with model_span(rt.tracing, claimed, request, agent.model) as span:
                async with d.cancelled_when_lost():
                    response = await _complete(rt, agent, request, sid, tid, attempt.no)
                answered(span, response)
        except TakenOver:
            raise
        except ProviderRejected as exc:
            # The provider refused the request itself (a 4xx): trying again cannot help.
            log.warning("model.rejected", error=str(exc))
            failed = claimed.model_copy(
                update={
                    "status": TurnStatus.FAILED,
                    "attempt": None,
                    "error": f"the model provider rejected model step {n}: {exc}",
                }
            )
            await d.commit(failed)
            await end_turn(rt, failed)
            return
        except ProviderRetryable as exc:
            wait = exc.retry_after
            if exc.status != 429 or not wait:
                await _attempt_failed(d, claimed, attempt.no, exc)
            # Too many requests, and the provider said for how long: not this step's fault, so
            # not one of its attempts; every worker calling that endpoint waits as long.
            await admission.throttled(exc, wait)
            await d.commit(_unused(claimed, used))
            raise RetryLater(wait, f"model call throttled: {exc}") from exc
        except Exception as exc:
            await _attempt_failed(d, claimed, attempt.no, exc)

        # Paid for: on its way to the ledger at once, so a crash before the commit that makes
        # this step run again still counts this call (jetloop.consumers.usage). The commit
        # does not wait for it: both are in flight together, and the step waits for both
        # before it publishes what follows (a commit whose usage was lost with a server is
        # told again from the record: ``usage_again``).
        usage = usage_event(rt.prices, agent.model, request, response)
        ledger = asyncio.ensure_future(record_usage(rt.bus, usage))
        bill = usage.payload()
        assert isinstance(bill, ModelUsageData)
        spent = spent.plus(bill.input_tokens, bill.output_tokens, bill.cost_usd)
        admission.used = bill.input_tokens + bill.output_tokens
    finally:
        await admission.close()
    try:
        committed = await _plan(rt, tools, claimed, response, spent)
        await rt.faults.point("run_model.before_commit")
        await d.commit(committed)
    except BaseException:
        with contextlib.suppress(Exception):
            await ledger  # still sent: the call was paid for, whatever became of the commit
        raise
    await ledger  # confirmed before anything follows, or the step is handed back
    log.debug("model.answered", calls=len(committed.calls), status=committed.status.value)
    await rt.faults.point("run_model.after_commit")
    if committed.status == TurnStatus.COMPLETED:
        await end_turn(rt, committed, session)
    else:
        await answer(committed, rt.calls_in_one_message, folded=rt.folded_log).publish(rt.bus)


ATTEMPT = "attempt"


async def _attempt_failed(d: Delivery, claimed: TurnRecord, no: int, exc: Exception) -> NoReturn:
    """A model call failed: the attempt ended (it was not lost) and is recorded so, the next
    one no resume; its cause is what the turn's error names if this was the last attempt.
    Raises the ``RetryLater`` that hands the step back (after ``Retry-After`` when given)."""
    log.warning("model.call_failed", error=str(exc))
    await d.commit(
        claimed.model_copy(update={"attempt": None, "error": f"{ATTEMPT} {no}: {_cause(exc)}"})
    )
    delay = min(30.0, 0.5 * 2 ** (no - 1))
    if isinstance(exc, ProviderRetryable) and exc.retry_after:
        delay = max(delay, exc.retry_after)  # honour Retry-After with a delayed nak
    raise RetryLater(delay, f"model call failed: {exc}") from exc


def _exhausted(n: int, turn: TurnRecord) -> str:
    """The error of a turn whose model step used up its attempts, with the last one's cause
    (recorded by that attempt as ``attempt <no>: <cause>``): what a user reads in ``send``,
    the snapshot, the gateway and the console, without the worker's log."""
    reason = f"model step {n} failed after {turn.attempts} attempts"
    last = turn.error or ""
    if last.startswith(f"{ATTEMPT} "):
        last = last.partition(": ")[2]
    return f"{reason}: {last}" if last else reason


def _cause(exc: BaseException) -> str:
    """A failed model call in one line: each error of the chain with its type (an SDK's
    ``Connection error.`` says little without the ``ConnectError`` under it) and the URL the
    request went to when an error carries it, without its query (it may hold a key). A
    provider's own error already names the provider and what went wrong."""
    if isinstance(exc, ProviderError):
        return str(exc)
    parts: list[str] = []
    url = ""
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 3:
        text = str(seen).strip().splitlines()
        parts.append(f"{type(seen).__name__}: {text[0]}" if text else type(seen).__name__)
        url = url or _request_url(seen)
        seen = seen.__cause__
    return " ← ".join(parts) + (f" ({url})" if url else "")


def _request_url(exc: BaseException) -> str:
    try:  # httpx raises on ``.request`` of an error made without one
        request = getattr(exc, "request", None)
    except RuntimeError:
        return ""
    url = getattr(request, "url", None)
    return str(url).partition("?")[0] if url is not None else ""


async def _with_its_inputs(
    rt: Runtime, turn: TurnRecord, history: list[HistoryEntry]
) -> list[HistoryEntry]:
    """The history with the entries this step's predecessor published beside its message
    (``followers.expected_history``): read again if one was still on its way, published
    again from state (same message ids) if it was lost with a publish that failed."""
    want = expected_history(turn)

    def missing(entries: list[HistoryEntry]) -> list[str]:
        have = {e.key for e in entries}
        return [k for k in want if k not in have]

    if not missing(history):
        return history
    sid, tid, n = turn.session_id, turn.turn_id, turn.model_step
    history = await rt.history.read(sid)
    lost = missing(history)
    if not lost:
        return history
    if n == 0:
        # (Folded: ``turn.accepted`` rides in the user's entry of a turn started at once; a
        # turn that was queued has it on its own already, which a reader keeps: the first of
        # a key.)
        accepted = accepted_event(turn, queued=False) if rt.folded_log else None
        records = turn_start(turn, folded=rt.folded_log, accepted=accepted).records
    else:
        _, calls = await rt.state.join_view(sid, tid, n - 1)
        results = [v.value for v in calls if v is not None and v.value.done]
        if len(results) != len(turn.calls):
            raise RetryLater(0.2, f"the results of model step {n - 1} are not all recorded")
        records = results_again(turn, results, folded=rt.folded_log)
    log.warning("history.restored", missing=lost)
    await rt.bus.publish(records)
    history = await rt.history.read(sid)
    lost = missing(history)
    if lost:
        raise RetryLater(0.2, f"history entries {lost} are not stored yet")
    return history


async def _complete(
    rt: Runtime, agent: Agent, request: ModelRequest, sid: str, tid: str, attempt: int
) -> ModelResponse:
    """Call the model; an adapter that streams sends text deltas to the turn's live subject
    (core NATS, not durable: the history records the final text once)."""
    if not getattr(agent.model, "supports_streaming", False):
        return await agent.model.complete(request)
    subject = live_subject(sid, tid)
    hdrs = {"Jl-Attempt": str(attempt)}

    async def on_delta(text: str) -> None:
        await rt.nc.publish(subject, text.encode(), headers=hdrs)

    complete: Any = agent.model.complete
    response: ModelResponse = await complete(request, on_delta=on_delta)
    return response


def own_pool(t: Tool | None) -> str | None:
    """The pool a call of ``t`` goes to when not the tool pool (``PlannedCall.pool``)."""
    return t.pool if t is not None and t.pool != DEFAULT_TOOL_POOL else None


async def _plan(
    rt: Runtime, tools: Sequence[Tool], turn: TurnRecord, resp: ModelResponse, spent: Spent
) -> TurnRecord:
    """The write-ahead checkpoint: the answer and every call it asks for (of the tools the
    model was offered), not yet made, and what the turn's model calls have used with this
    one. Each call's effect is written here, and never read again from the tool; so is its
    idempotency key (of this worker's namespace), which the call keeps across upgrades."""
    offered = {t.name: t for t in tools}
    sid, tid, n = turn.session_id, turn.turn_id, turn.model_step
    assert turn.attempt is not None
    text: str | None = resp.text
    text_ref = None
    raw = (resp.text or "").encode()
    if rt.blobs.too_big(raw):
        text_ref = await rt.blobs.put(f"{sid}.{tid}.m{n}.a{turn.attempt.no}.text", raw)
        text = None
    calls = []
    for i, c in enumerate(resp.tool_calls):
        t = offered.get(c.name)
        invalid = None
        if isinstance(c, MalformedToolCall):
            invalid = f"malformed arguments for {c.name}: {c.problem}"
            effect = t.effect.value if t is not None else "read"
        elif t is None:
            invalid = f"unknown tool {c.name!r}"
            effect = "read"
        else:
            effect = t.effect.value
            try:
                t.args_model.model_validate(c.arguments)
            except ValidationError as exc:
                invalid = f"invalid arguments for {c.name}: {exc.errors()[0]['msg']}"
        calls.append(
            PlannedCall(
                index=i,
                call_id=call_id(tid, n, i),
                provider_id=c.provider_id,
                tool=c.name,
                args=c.arguments,
                effect=effect,
                idempotency_key=idempotency_key(sid, tid, n, i, rt.namespace),
                invalid=invalid,
                # A call that cannot run is settled by the tool pool, whatever its tool's.
                pool=own_pool(t) if invalid is None else None,
            )
        )
    update: dict[str, Any] = {
        "usage": dict(resp.usage),
        "spent": spent,
        "answer_text": text,
        "answer_ref": text_ref,
        "attempt": None,
        "calls": calls,
    }
    if calls:
        update["phase"] = TurnPhase.CALLS
    else:
        update["status"] = TurnStatus.COMPLETED
    return turn.model_copy(update=update)
