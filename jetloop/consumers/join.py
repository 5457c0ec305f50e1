"""The join: when every call of a model step has its outcome, the turn moves to the next step.

The step that commits a call's outcome joins right after, in the same delivery (no join
message of its own; the calls of one ``call_tools`` message each join so). Of the calls that
find every outcome in, the one committed last moves the turn on (``_elected``); the others
find calls still open, the turn moved, or another call elected, and stop. The move is one CAS
on the turn record from the revision read: two joins racing cannot both win. The winner
publishes what follows before its step is acked; if it dies before that, its call step is
redelivered, finds its outcome committed and the turn moved, and publishes it (same message
ids: it lands once). So a first delivery that finds the turn already moved has nothing to
do. The turn and its step's call records are read in one request
(``StateStore.join_view``). ``on_join`` still handles join messages a worker of an earlier
version published.

A ``call_tools`` message that carries every call of its step needs no read and no election:
its parts know every outcome, each committed (or found committed) by one of them, and the
turn as they read it. The part that ends the last outcome moves the turn from that
(``StepCalls``, ``_join_known``). A part whose sibling still runs does not join: the sibling
ends the set, or joins from state, or the message is handed back and its calls, found done,
join again. A part whose sibling ended its part without an outcome (it began a wait) joins
from state, as a call of its own message does: the sibling's wait may have ended since, by its
own message, whose join found this call still open.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from jetloop.consumers.carry import carry
from jetloop.consumers.errors import DeadLetter, RetryLater, TakenOver
from jetloop.consumers.followers import Followers, call_done, joined, results_told
from jetloop.consumers.runtime import Delivery
from jetloop.consumers.side_by_side import side_by_side
from jetloop.schemas import (
    CallRecord,
    SessionRecord,
    StepMessage,
    StepReads,
    TurnPhase,
    TurnRecord,
)
from jetloop.streams.connection import message_size
from jetloop.streams.state import Conflict, Versioned, step_reads_key, turn_key

# A read's outcome is kept with its step's other reads only while it is this small (JSON
# bytes, its error included): a larger one has its own record.
KEPT_READ_BYTES = 4096
# What a kept read's record adds to its outcome in the step's reads record (its key, tool,
# state, attempts, field names), counted generously.
KEPT_READ_OVERHEAD = 512


@dataclass
class StepCalls:
    """What the parts of one ``call_tools`` message know of their step: the turn as they
    read it (the newest revision any of them read) and the outcomes they committed or found
    committed, by call index. ``parts``: the message's parts, call ``i`` the ``i``-th."""

    parts: list[Delivery]
    turn: Versioned[TurnRecord] | None = None
    session: Versioned[SessionRecord] | None = None
    done: dict[int, CallRecord] = field(default_factory=dict)
    # Outcomes of reads not written yet: kept for one ``StepReads`` record of all of them
    # (``keep_reads``), written before the turn moves, or before the message is settled.
    unrecorded: dict[int, CallRecord] = field(default_factory=dict)
    # What the outcomes kept for that record weigh (``keeps``).
    kept_bytes: int = 0

    def saw(self, turn: Versioned[TurnRecord], session: Versioned[SessionRecord] | None) -> None:
        if self.turn is None or turn.revision > self.turn.revision:
            self.turn = turn
        if session is not None and (
            self.session is None or session.revision > self.session.revision
        ):
            self.session = session

    def keeps(self, size: int, max_payload: int) -> bool:
        """Whether an outcome of ``size`` bytes is kept for the step's reads record: while
        it is small (``KEPT_READ_BYTES``), and while the record stays within half the
        server's limit on a message (an account's limit may be low), each kept outcome
        counted with ``KEPT_READ_OVERHEAD`` for its record's other fields. A read not kept
        writes a record of its own."""
        weight = size + KEPT_READ_OVERHEAD
        if size > KEPT_READ_BYTES or self.kept_bytes + weight > max_payload // 2:
            return False
        self.kept_bytes += weight
        return True

    def carries_every_call(self, turn: TurnRecord) -> bool:
        return len(self.parts) == len(turn.calls)

    def ended(self, index: int, rec: CallRecord, recorded: bool = True) -> Join:
        """Record call ``index``'s outcome (``recorded``: committed to its own record; else
        to be kept with the step's other reads), and say how its part joins."""
        self.done[index] = rec
        if not recorded:
            self.unrecorded[index] = rec
        if len(self.done) == len(self.parts):
            return Join.KNOWN  # the step's last outcome: every one is known here
        if any(p.ended and i not in self.done for i, p in enumerate(self.parts)):
            # A sibling ended without an outcome (a wait): it may have ended since by its
            # own message, whose join found this call open; so this one joins from state.
            return Join.READ
        return Join.NOT_YET  # a sibling still runs: it ends the set, or joins from state


class Join(Enum):
    """How a part of a ``call_tools`` message joins once its outcome is committed."""

    KNOWN = "known"
    READ = "read"
    NOT_YET = "not yet"


def _results(got: list[Versioned[CallRecord] | None]) -> list[CallRecord] | None:
    if any(v is None or not v.value.done for v in got):
        return None
    return [v.value for v in got if v is not None]


def _moved_on(turn: TurnRecord, n: int) -> bool:
    return turn.model_step == n + 1 and turn.phase == TurnPhase.MODEL


def _elected(calls: list[Versioned[CallRecord] | None], own: int) -> bool:
    """Whether call ``own`` moves the turn, of the joins that find every outcome in: the one
    whose record has the highest revision, i.e. was committed last.

    Without an election, calls finishing together all found every outcome in and raced one
    CAS on the turn; each loser paid a failed write and a read (3.7 of each per 7-step turn
    under load). The call committed last always finds every outcome in, since its join reads
    after its own commit; it is also the last write of the step's records: a done record is
    not written again by its step (the heartbeat stops rewriting it, ``Delivery``), and a
    reconcile, which does rewrite one, publishes a join message of its own (``on_join``,
    which joins unelected). A join that fails after the election is redelivered and joins
    again unelected (``first`` is False then)."""
    top = max(v.revision for v in calls if v is not None)
    mine = calls[own] if own < len(calls) else None
    return mine is not None and mine.revision == top


async def on_join(d: Delivery, step: StepMessage) -> None:
    await join_calls(d, step.session_id, step.turn_id, step.model_step, d.first_sight)


async def join_calls(
    d: Delivery, sid: str, tid: str, n: int, first: bool, own: int | None = None
) -> None:
    """Move turn ``tid`` past model step ``n`` if every call of the step has its outcome.
    ``first``: this step committed an outcome just now (rather than finding it committed):
    a turn already moved on was then moved by another step, which publishes what follows.
    ``own``: the index of the call whose outcome this step committed just now (see
    ``_elected``)."""
    rt = d.rt
    cur, calls = await rt.state.join_view(sid, tid, n)
    if cur is None:
        raise DeadLetter(f"join for turn {tid} of session {sid}, which has no record")
    turn = cur.value
    if turn.status.terminal:
        return
    if _moved_on(turn, n):
        if first:
            return  # another step moved it; its message is not acked until it published
        # Maybe this message moved it and its worker died before publishing what follows.
        results = _results(calls)
        if results is not None:
            await joined(turn, results, folded=rt.folded_log).publish(rt.bus)
        return
    if turn.model_step != n or turn.phase != TurnPhase.CALLS:
        return
    results = _results(calls)
    if results is None:
        return  # a later call's join will move the turn
    if first and own is not None and not _elected(calls, own):
        return  # the call committed last moves the turn
    moved = _moved(turn, n, results)
    try:
        await rt.state.write(turn_key(sid, tid), moved, cur.revision)
    except Conflict:
        again = await rt.state.turn(sid, tid)
        if again is not None and (again.value.status.terminal or _moved_on(again.value, n)):
            return  # another join won the race (or the turn ended): it publishes what follows
        raise RetryLater(0.02, "turn changed while joining") from None
    await rt.faults.point("join.before_publish")
    await joined(moved, results, folded=rt.folded_log).publish(rt.bus)


async def _join_known(d: Delivery, known: StepCalls, n: int) -> None:
    """Move the turn past step ``n`` from what the parts of a ``call_tools`` message know:
    every outcome, and the turn as read before the calls ran. A CAS from that revision, as
    any join's move; a turn written since (cancelled, say) fails it, and the join is then
    done from state as a redelivered call's is."""
    cur = known.turn
    assert cur is not None, "a part records the turn it read before it ends its call"
    turn = cur.value
    sid, tid = turn.session_id, turn.turn_id
    if turn.status.terminal or turn.model_step != n or turn.phase != TurnPhase.CALLS:
        await join_calls(d, sid, tid, n, first=False)
        return
    told = await keep_reads(d, known)
    results = [known.done[i] for i in range(len(known.parts))]
    moved = _moved(turn, n, results)
    try:
        rev = await d.rt.state.write(turn_key(sid, tid), moved, cur.revision)
    except Conflict:
        await told.publish(d.rt.bus)
        await join_calls(d, sid, tid, n, first=False)
        return
    await d.rt.faults.point("join.before_publish")
    session = known.session
    carried = None
    if session is not None:
        carried = carry(d.rt.state.sealer, moved, rev, session.value, session.revision)
    await (told + joined(moved, results, carried, folded=d.rt.folded_log)).publish(d.rt.bus)
    await d.rt.faults.point("join.after_publish")


async def keep_reads(d: Delivery, known: StepCalls) -> Followers:
    """Write the outcomes of the reads of ``known``'s message not written yet, together, in
    one ``StepReads`` record (a create: one write the server syncs, where each read's own
    record would be one), and return what tells the log of them, to publish after it. A
    record there already means another delivery of the message wrote the step's reads: a
    takeover. Nothing to do (and nothing to tell) when every outcome was written."""
    if not known.unrecorded:
        return Followers()
    cur = known.turn
    assert cur is not None, "a part records the turn it read before it ends its call"
    turn = cur.value
    reads = [known.unrecorded[i] for i in sorted(known.unrecorded)]
    key = step_reads_key(turn.session_id, turn.turn_id, turn.model_step)
    try:
        await d.rt.state.write(key, StepReads(calls=reads), None)
    except Conflict as exc:
        d.lost = True
        raise TakenOver(key) from exc
    known.unrecorded.clear()
    await d.rt.faults.point("call_tool.after_commit")
    if d.rt.folded_log and d.rt.results_entry:
        together = in_one_entry(turn, reads, d.rt.nc.max_payload)
        if together is not None:
            return together
    told = Followers()
    for rec in reads:
        told = told + call_done(turn, rec, folded=d.rt.folded_log)
    return told


def in_one_entry(turn: TurnRecord, reads: list[CallRecord], max_payload: int) -> Followers | None:
    """The outcomes of ``reads`` told in one history entry (``followers.results_told``), or
    None to tell them one entry each: for a single read, and for an entry that would not be
    well inside the server's limit on a message (an account's limit may be low; one entry
    each always fits where the step's reads record did). A delivery that finds them kept,
    after a crash before its ack, tells them one entry each; a reader keeps the first entry
    of each key."""
    if len(reads) < 2:
        return None
    together = results_told(turn, reads)
    (out,) = together.records
    if message_size(out.body, out.headers) > max_payload // 2:
        return None
    return together


def _moved(turn: TurnRecord, n: int, results: list[CallRecord]) -> TurnRecord:
    """The turn moved past model step ``n`` whose calls ended with ``results``."""
    return turn.model_copy(
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


async def outcome_told_and_joined(
    d: Delivery,
    turn: TurnRecord,
    rec: CallRecord,
    n: int,
    index: int,
    first: bool = True,
    recorded: bool = True,
) -> None:
    """A call's outcome is committed: tell the log and join, at the same time.

    The event's publish is started first and goes out before anything the join publishes
    (which waits for the join's read), so it is in the log first; it is not waited for
    before the join reads: nothing the join does depends on it, and both are confirmed
    before this returns, so before the step is acked. Either failing fails the
    step; its redelivery finds the outcome committed and does both again (message ids make
    the repeats land once). A takeover found by the join is what the step reports.

    A part of a ``call_tools`` message that carries every call of the step, its turn still
    at the step, joins without a read if its outcome is the step's last, not at all while a
    sibling still runs, and from state once a sibling began a wait (``StepCalls``).

    A read that ran unclaimed in such a message (``recorded`` False: its outcome is in no
    record yet) is kept with the step's other reads, one ``StepReads`` record for all of
    them: written by the join if its outcome is the step's last, else once every part of
    the message has ended (``call_tool.on_calls``); it is told to the log only after that
    write."""
    known = d.together
    current = turn.model_step == n and turn.phase == TurnPhase.CALLS and not turn.status.terminal
    if known is not None and current and known.carries_every_call(turn):
        how = known.ended(index, rec, recorded)
        if not recorded and how is not Join.KNOWN:
            return  # kept with the step's reads when the message's parts have ended
        if how is Join.NOT_YET:
            await call_done(turn, rec, folded=d.rt.folded_log).publish(d.rt.bus)
            return
        if how is Join.KNOWN:
            if not recorded:
                await _join_known(d, known, n)  # tells this read with the others it keeps
                return
            await side_by_side(
                call_done(turn, rec, folded=d.rt.folded_log).publish(d.rt.bus),
                _join_known(d, known, n),
            )
            return
    # (A read is kept unrecorded only in such a message, its turn current: ``_kept_with_reads``.)
    assert recorded, "an outcome in no record is told only once it is kept"
    await side_by_side(
        call_done(turn, rec, folded=d.rt.folded_log).publish(d.rt.bus),
        join_calls(d, turn.session_id, turn.turn_id, n, first=first, own=index),
    )
