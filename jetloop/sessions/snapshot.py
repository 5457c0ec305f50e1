"""get_agent_snapshot: everything about a session a person or a program needs, in one read.

Session status, history (paged), the current (or last) turn and its steps, every call with
its effect, status, attempts, idempotency key and error, pending approvals, questions,
timers and tasks, and the queued messages. JSON-able (it is also a NATS reply).
"""

from __future__ import annotations

import json
from typing import Any

from nats.js import JetStreamContext
from pydantic import BaseModel, Field

from jetloop.schemas import (
    DONE_STATES,
    ApprovalRecord,
    CallRecord,
    CallState,
    Decision,
    DecodeError,
    HistoryEntry,
    PolicyChange,
    QuestionRecord,
    SessionRecord,
    Spent,
    StepReads,
    TurnRecord,
    idempotency_key,
)
from jetloop.schemas.ids import DEFAULT_NAMESPACE, call_id
from jetloop.streams.blobs import BlobStore
from jetloop.streams.history import HistoryReader
from jetloop.streams.registry import Registry
from jetloop.streams.seal import SealBroken
from jetloop.streams.state import StateStore
from jetloop.streams.topology import TURNS_STREAM, session_turns_filter


class CallView(BaseModel):
    """One call as a reader sees it: ids, tool, effect, state, attempts, idempotency key,
    result (a large one fetched from the blob store) or error, and what it waits for."""

    call_key: str
    call_id: str
    model_step: int
    index: int
    tool: str
    effect: str
    state: str
    attempts: int
    idempotency_key: str
    result: Any = None
    error: str | None = None
    settlement: str | None = None
    approval_id: str | None = None
    question_id: str | None = None
    timer_due: float | None = None
    task_handle: Any = None
    reconciled_by: str | None = None


class QueuedView(BaseModel):
    turn_id: str
    request_id: str
    text: str


class SessionSnapshot(BaseModel):
    """Everything about a session in one read (``Client.snapshot``, the control API's
    ``snapshot``, the gateway's ``GET /v1/sessions/{session}``)."""

    session_id: str
    agent: str
    # idle | running | waiting (approval, answer, timer, task, child) | waiting_for_worker
    # (work is there, and no live worker serves the agent: see ``jetloop.streams.registry``)
    status: str
    turns_done: int
    # The model calls of the session's ended turns (its turn's own are ``turn.spent``).
    spent: Spent = Field(default_factory=Spent)
    # Requests published and not yet accepted by a worker of the agent (still in JL_TURNS).
    unaccepted: int = 0
    turn: TurnRecord | None = None
    calls: list[CallView] = Field(default_factory=list)
    queued: list[QueuedView] = Field(default_factory=list)
    approvals: list[ApprovalRecord] = Field(default_factory=list)
    questions: list[QuestionRecord] = Field(default_factory=list)
    timers: list[CallView] = Field(default_factory=list)
    tasks: list[CallView] = Field(default_factory=list)
    approval_overrides: dict[str, bool] = Field(default_factory=dict)
    # Who last changed each tool's override, when, and from what (``SessionRecord``).
    approval_changes: dict[str, PolicyChange] = Field(default_factory=dict)
    summary: str | None = None
    history: list[HistoryEntry] = Field(default_factory=list)
    history_total: int = 0
    history_offset: int = 0
    # Records of this session whose seal does not verify, as "<key>: <why>": the engine
    # acts on none of them (a turn that meets one fails; a control request on one is
    # refused). A session record here refuses new turns until it is deleted.
    untrusted: list[str] = Field(default_factory=list)


# The state shown for a call whose record does not verify or decode.
UNREADABLE = "unreadable"

WAITING = {
    CallState.AWAITING_APPROVAL,
    CallState.AWAITING_ANSWER,
    CallState.WAITING_TIMER,
    CallState.TASK_RUNNING,
    CallState.AWAITING_CHILD,
}


async def unaccepted_requests(js: JetStreamContext, session_id: str) -> dict[str, int]:
    """Requests of a session still waiting in ``JL_TURNS``, counted per agent."""
    info = await js.stream_info(TURNS_STREAM, subjects_filter=session_turns_filter(session_id))
    out: dict[str, int] = {}
    for subject, n in (info.state.subjects or {}).items():
        out[subject.split(".")[2]] = out.get(subject.split(".")[2], 0) + n
    return out


async def with_workers(
    snap: SessionSnapshot | None, js: JetStreamContext, registry: Registry, session_id: str
) -> SessionSnapshot | None:
    """Add what only the streams and the registry know: requests no worker has taken yet,
    and whether the session's work waits for a worker of its agent. A session whose first
    request is still unaccepted has no record yet; it gets a snapshot of its own."""
    pending = await unaccepted_requests(js, session_id)
    if snap is None:
        if not pending:
            return None
        agent = next(iter(pending))
        snap = SessionSnapshot(session_id=session_id, agent=agent, status="idle", turns_done=0)
    snap.unaccepted = sum(pending.values())
    if (snap.status != "idle" or snap.unaccepted) and await registry.status(snap.agent) != "live":
        snap.status = "waiting_for_worker"
    return snap


async def _turn(
    state: StateStore, session_id: str, turn_id: str, untrusted: list[str]
) -> TurnRecord | None:
    """A turn as it stands, trusted or not (its run refuses an untrusted one; a reader
    still shows it, and notes it in ``untrusted``); None when it is not there or cannot be
    read at all."""
    try:
        tv = await state.turn(session_id, turn_id)
    except SealBroken as exc:
        untrusted.append(f"{exc.key}: {exc.reason}")
        try:
            tv = await state.turn(session_id, turn_id, verify=False)
        except DecodeError:
            return None
    return tv.value if tv else None


def _key_of(turn: TurnRecord, step: int, index: int, namespace: str) -> str:
    """A call's idempotency key: the one its plan stored, while the turn still holds the plan
    of its step (a call planned by an older release keeps the key it was given), else made
    again (the calls of a turn's earlier model steps)."""
    if step == turn.model_step:
        for c in turn.calls:
            if c.index == index:
                return c.idempotency_key
    return idempotency_key(turn.session_id, turn.turn_id, step, index, namespace)


def _unreadable(
    turn: TurnRecord, key: str, step: int, index: int, exc: Exception, namespace: str
) -> CallView:
    """A call whose record does not verify or decode: shown, with why, instead of failing
    the whole snapshot. Its turn fails when a step meets it (``closing.reject_untrusted``)."""
    planned = next((c for c in turn.calls if c.index == index), None)
    why = exc.reason if isinstance(exc, SealBroken) else str(exc)
    return CallView(
        call_key=key.removeprefix("call."),
        call_id=call_id(turn.turn_id, step, index),
        model_step=step,
        index=index,
        tool=planned.tool if planned and step == turn.model_step else "",
        effect=planned.effect if planned and step == turn.model_step else "",
        state=UNREADABLE,
        attempts=0,
        idempotency_key=_key_of(turn, step, index, namespace),
        error=f"unreadable record: {why}",
    )


# At most this many calls of one turn are read at once (a turn's calls are bounded by its
# agent's limits; this bounds a reply whatever they are).
MOST_CALLS = 1000


async def turn_calls(
    state: StateStore,
    blobs: BlobStore,
    turn: TurnRecord,
    untrusted: list[str],
    resolve_results: bool = True,
    most: int = MOST_CALLS,
    namespace: str = DEFAULT_NAMESPACE,
) -> tuple[list[CallView], int]:
    """Every call record of a turn (every model step's), in order (model step, then index),
    at most ``most``, and how many more there are. One that does not verify or decode is
    shown as ``unreadable`` and noted in ``untrusted``. Large results are fetched from the
    blob store unless ``resolve_results`` is off (then their ``{blob, size}`` reference).
    ``namespace``: the one the turn lives in (its calls' idempotency keys are made of it)."""
    sid, tid = turn.session_id, turn.turn_id
    found, more = await state.matching(f"call.{sid}.{tid}.>", most)
    kept_reads, _ = await state.matching(f"reads.{sid}.{tid}.*", most)

    def order(k: str) -> tuple[int, int]:
        parts = k.split(".")
        return int(parts[-2]), int(parts[-1])

    # A step's reads kept together (``StepReads``) are shown as the calls they are.
    records: dict[str, CallRecord | Exception] = {}
    for key, raw_reads in kept_reads.items():
        try:
            kept = state.typed(StepReads, key, raw_reads)
        except (SealBroken, DecodeError) as exc:
            untrusted.append(f"{key}: {getattr(exc, 'reason', exc)}")
            continue
        for rec in kept.value.calls if kept is not None else []:
            records.setdefault(f"call.{rec.key}", rec)
    for key, raw in found.items():
        try:
            rv = state.typed(CallRecord, key, raw)
        except (SealBroken, DecodeError) as exc:
            records[key] = exc
            continue
        if rv is not None:
            records[key] = rv.value

    shown = sorted(records, key=order)
    more += max(0, len(shown) - most)
    calls: list[CallView] = []
    for key in shown[:most]:
        step, index = order(key)
        rec_or_error = records[key]
        if isinstance(rec_or_error, Exception):
            calls.append(_unreadable(turn, key, step, index, rec_or_error, namespace))
            untrusted.append(f"{key}: {getattr(rec_or_error, 'reason', rec_or_error)}")
            continue
        rec = rec_or_error
        result: Any = None
        if rec.outcome is not None:
            result = rec.outcome.result
            if rec.outcome.result_ref is not None:
                result = (
                    json.loads(await blobs.get(rec.outcome.result_ref))
                    if resolve_results
                    else rec.outcome.result_ref.model_dump()
                )
        calls.append(
            CallView(
                call_key=rec.key,
                call_id=call_id(tid, step, index),
                model_step=step,
                index=index,
                tool=rec.tool,
                effect=rec.effect,
                state=rec.state.value,
                attempts=rec.attempts,
                idempotency_key=_key_of(turn, step, index, namespace),
                result=result,
                error=rec.outcome.error if rec.outcome else None,
                settlement=rec.settlement,
                approval_id=rec.approval_id,
                question_id=rec.question_id,
                timer_due=rec.timer_due,
                task_handle=rec.task_handle,
                reconciled_by=rec.reconciled_by,
            )
        )
    return calls, more


async def snapshot(
    state: StateStore,
    history: HistoryReader,
    blobs: BlobStore,
    session_id: str,
    history_offset: int = 0,
    history_limit: int = 50,
    resolve_results: bool = True,
    namespace: str = DEFAULT_NAMESPACE,
) -> SessionSnapshot | None:
    untrusted: list[str] = []
    try:
        sv = await state.session(session_id)
    except SealBroken as exc:
        untrusted.append(f"{exc.key}: {exc.reason}")
        try:
            sv = await state.session(session_id, verify=False)
        except DecodeError:
            return None
    if sv is None:
        return None
    session: SessionRecord = sv.value
    tid = session.active or session.last_turn
    turn = None
    if tid is not None:
        turn = await _turn(state, session_id, tid, untrusted)

    calls: list[CallView] = []
    if turn is not None:
        calls, _ = await turn_calls(
            state, blobs, turn, untrusted, resolve_results, namespace=namespace
        )

    approvals = []
    for key in await state.keys(f"approval.{session_id}.>"):
        try:
            av = await state.approval(session_id, key.split(".")[-1])
        except (SealBroken, DecodeError) as exc:
            untrusted.append(f"{key}: {getattr(exc, 'reason', exc)}")
            continue
        if av is not None and av.value.status == Decision.PENDING:
            approvals.append(av.value)
    questions = []
    for key in await state.keys(f"question.{session_id}.>"):
        try:
            qv = await state.question(session_id, key.split(".")[-1])
        except (SealBroken, DecodeError) as exc:
            untrusted.append(f"{key}: {getattr(exc, 'reason', exc)}")
            continue
        if qv is not None and not qv.value.answered:
            questions.append(qv.value)

    queued = []
    for q in session.queue:
        qv2 = await _turn(state, session_id, q, untrusted)
        if qv2 is not None:
            text = qv2.text if qv2.text_ref is None else f"({qv2.text_ref.size} bytes, in jl_blobs)"
            queued.append(QueuedView(turn_id=q, request_id=qv2.request_id, text=text))

    entries = await history.read(session_id)
    open_calls = [
        c for c in calls if c.state != UNREADABLE and CallState(c.state) not in DONE_STATES
    ]
    if session.active is None or (turn is not None and turn.status.terminal and not session.queue):
        status = "idle"
    elif open_calls and all(CallState(c.state) in WAITING for c in open_calls):
        status = "waiting"
    else:
        status = "running"
    return SessionSnapshot(
        session_id=session_id,
        agent=session.agent,
        status=status,
        turns_done=session.turns_done,
        spent=session.spent,
        turn=turn,
        calls=calls,
        queued=queued,
        approvals=approvals,
        questions=questions,
        timers=[c for c in calls if c.state == CallState.WAITING_TIMER],
        tasks=[c for c in calls if c.state == CallState.TASK_RUNNING],
        approval_overrides=session.approval_overrides,
        approval_changes=session.approval_changes,
        summary=session.summary.text if session.summary else None,
        history=entries[history_offset : history_offset + history_limit],
        history_total=len(entries),
        history_offset=history_offset,
        untrusted=untrusted,
    )
