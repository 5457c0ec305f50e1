"""Loss accounting: a turn is lost once for every worker that lost it.

An attempt is lost when its lease lapses and another attempt finds its claim: its worker
died, stalled, or could not reach the servers for longer than the lease. A loss is named by
the lost attempt's worker incarnation (one worker process), so every step that one failure
left behind — the parallel calls of a step, a whole election's worth of steps — counts as
one loss, and counting it again after a redelivery changes nothing. A turn lost by more than
``JETLOOP_MAX_LOSSES`` workers (default 2) — a turn that keeps killing its workers — fails
with the reason; its calls are settled by ``close_turn`` and waiting callers are told. A
step's own attempts bound how often one step runs, whoever loses it.

A holder that stopped on purpose is not a loss: a worker whose drain ran out (SIGTERM, then
``drain_seconds``, during a deploy) says so before it cancels what it still runs
(``jetloop.streams.holds.drained``). The step is resumed as after a crash — a call in doubt
is settled the same way, since the cancelled call may have run — and audited, with
``drained`` set, but the turn's losses stay as they were: deploys cannot fail a turn.

Nor is a holder that lives and has stopped working on the step
(``jetloop.consumers.liveness.Takeover.ABANDONED``): its delivery ended unfinished, an outage
outlasting its writes' retries, say. Resumed and audited with ``abandoned`` set, not counted:
a network fault that ends deliveries on live workers cannot fail a turn this way either. The
step's own attempts still bound how often it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jetloop.consumers import metrics
from jetloop.consumers.closing import fail_turn
from jetloop.consumers.errors import RetryLater
from jetloop.consumers.liveness import Takeover
from jetloop.consumers.runtime import Runtime
from jetloop.schemas import Attempt, Event, TurnRecord
from jetloop.schemas.events import CrashResumedData, TurnLostData
from jetloop.streams.bus import event_out
from jetloop.streams.holds import drained
from jetloop.streams.state import Conflict, turn_key


def loss_id(lost: Attempt) -> str:
    return f"{lost.worker}/{lost.incarnation}"


def lost_reason(turn: TurnRecord, losses: int, step_key: str) -> str:
    return (
        f"the turn was lost {losses} times (its worker died or stalled past the lease); "
        f"the last loss was at {step_key}"
    )


def lost_event(turn: TurnRecord, losses: int, step_key: str) -> Event:
    return Event.of(
        TurnLostData(losses=losses, step=step_key),
        key=f"{turn.session_id}.{turn.turn_id}.lost",
        session_id=turn.session_id,
        turn_id=turn.turn_id,
    )


@dataclass(frozen=True)
class Resume:
    """A takeover of a lost attempt: the turn's losses after it, and whether the holder had
    stopped on purpose or lives and had stopped working on the step (then not counted)."""

    losses: int
    drained: bool = False
    abandoned: bool = False  # its holder lives and had stopped working on it


async def not_a_loss(rt: Runtime, lost: Attempt, why: Takeover) -> tuple[bool, bool]:
    """Whether the lost attempt's holder had stopped on purpose (drained) or lives and had
    stopped working on the step (abandoned): either way not a loss of the turn."""
    if why == Takeover.ABANDONED:
        return False, True
    return await drained(rt.js, lost.incarnation), False


async def record_loss(
    rt: Runtime, turn_sid: str, turn_tid: str, step_key: str, lost: Attempt, why: Takeover
) -> Resume | None:
    """Count the loss on the turn record; None when it was one too many (the turn failed)."""
    lid = loss_id(lost)
    metrics.TAKEOVERS.inc()
    stopped, abandoned = await not_a_loss(rt, lost, why)
    for _ in range(20):
        cur = await rt.state.turn(turn_sid, turn_tid)
        assert cur is not None
        turn = cur.value
        if lid in turn.lost or stopped or abandoned:
            return Resume(len(turn.lost), drained=stopped, abandoned=abandoned)
        losses = [*turn.lost, lid]
        if len(losses) > rt.max_losses:
            await fail_turn(
                rt,
                turn.model_copy(update={"lost": losses}),
                cur.revision,
                lost_reason(turn, len(losses), step_key),
                lost_event(turn, len(losses), step_key),
            )
            return None
        try:
            await rt.state.write(
                turn_key(turn_sid, turn_tid), turn.model_copy(update={"lost": losses}), cur.revision
            )
        except Conflict:
            continue
        return Resume(len(losses))
    raise RetryLater(0.05, "turn kept changing while counting a loss")


async def tell_resumed(
    rt: Runtime,
    turn: TurnRecord,
    step_key: str,
    lost: Attempt,
    resume: Resume,
    settled: dict[str, Any],
) -> None:
    """The audit of a resume: which step, how many losses, how its calls were settled."""
    await rt.bus.publish(
        [
            event_out(
                Event.of(
                    CrashResumedData(
                        step=step_key,
                        losses=resume.losses,
                        drained=resume.drained,
                        abandoned=resume.abandoned,
                        lost_attempt=lost.no,
                        lost_worker=lost.worker,
                        lost_incarnation=lost.incarnation,
                        settled=settled,
                    ),
                    key=f"{step_key}.resumed.{lost.no}",
                    session_id=turn.session_id,
                    turn_id=turn.turn_id,
                )
            )
        ]
    )
