"""The one place a message's fate is decided (docs/design.md, rule 7).

A handler returns (ack) or raises a ``StepOutcome``; ``dispatch`` acks, naks, terms or
dead-letters accordingly, and runs the heartbeat while the handler works. No handler calls
``ack()`` itself. A taken-over attempt sends nothing at all on its message: JetStream does
not fence late acks, so an ack from a stale worker could settle the live worker's delivery.

Any other exception is sorted by whether a retry can cure it (``fate``):

- a body or record that does not decode or validate (``DecodeError``, pydantic's
  ``ValidationError``), a state record whose seal does not verify where no turn can be
  failed for it (``SealBroken``; a step's own checkpoint fails its turn instead, see
  ``jetloop.consumers.router``), or a message the step would publish that is over the server's
  ``max_payload`` (``PayloadTooLarge``): dead-lettered at once, with the reason;
- an outage or a lost race (``TRANSIENT_ERRORS``: NATS timeouts, no responders, a
  connection closed or reconnecting, ``Conflict``): nak'd with backoff (0.2 s doubling to
  ``OUTAGE_BACKOFF`` = 2 s, each delay up to a quarter longer at random so that the steps of
  an outage do not all come back at once) for up to ``TRANSIENT_FOR`` seconds of failing
  deliveries, then dead-lettered. Capped low because an outage ends all at once (a node back
  from a partition answered "JetStream temporarily unavailable" for 6 s, then everything): a
  step waiting out a 30 s backoff would stall that long past it;
- this process's clock found too far off to seal (``ClockOff``, ``jetloop.streams.clock``):
  handed back at once, not counted, for a worker whose clock is right;
- anything else (a bug, a refusal from the server): nak'd with backoff for
  ``UNEXPECTED_TRIES`` deliveries (about 3 s), then dead-lettered with the error.

Failing deliveries are counted per message by this worker process (``Failures``): a
redelivery the handler settled another way (a ``RetryLater`` wait, a takeover) does not
count, and neither does one another worker failed, so with N workers a poison message is
tried at most N times the bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
from nats.aio.msg import Msg
from nats.errors import (
    ConnectionReconnectingError,
    OutboundBufferLimitError,
    StaleConnectionError,
)
from pydantic import ValidationError

from jetloop.consumers import metrics
from jetloop.consumers.closing import fail_turn
from jetloop.consumers.errors import DeadLetter, RetryLater, TakenOver
from jetloop.consumers.logcontext import end_step, start_step
from jetloop.consumers.runtime import Delivery, Runtime
from jetloop.schemas import DecodeError, Event, NewerWriter, StepKind
from jetloop.schemas.events import StepDeadLetteredData
from jetloop.streams.bus import H_KIND, H_SESSION, H_STEP, H_TURN
from jetloop.streams.clock import ClockOff
from jetloop.streams.connection import PayloadTooLarge, message_size
from jetloop.streams.seal import SealBroken
from jetloop.streams.state import RETRYABLE, Conflict
from jetloop.streams.topology import STEPS_STREAM, dead_subject, is_step_subject

log = structlog.get_logger("jetloop.dispatch")

Handler = Callable[[Delivery], Awaitable[None]]

MAX_BACKOFF = 30.0
# What an outage or a race looks like: time cures it.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    *RETRYABLE,
    ConnectionReconnectingError,
    StaleConnectionError,
    OutboundBufferLimitError,
    ConnectionError,
    Conflict,
)
# What no retry cures: the message (or a record it names) is not what the code reads.
# A message the step would publish that passes the server's max_payload is one too.
INCURABLE_ERRORS: tuple[type[BaseException], ...] = (
    DecodeError,
    ValidationError,
    PayloadTooLarge,
    SealBroken,
)
TRANSIENT_FOR = 900.0
# How soon a step written by a newer jetloop is offered again (to a newer worker, maybe).
NEWER_WRITER_RETRY = 2.0
UNEXPECTED_TRIES = 5


def backoff(num_delivered: int) -> float:
    return float(min(MAX_BACKOFF, 0.2 * 2 ** min(num_delivered - 1, 8)))


OUTAGE_BACKOFF = 2.0
OUTAGE_JITTER = 0.25


def outage_backoff(failures: int) -> float:
    """The delay before a step that failed ``failures`` times in a row in an outage is tried
    again: short, since an outage ends for every step at once, and spread."""
    return min(OUTAGE_BACKOFF, backoff(failures)) * (1.0 + OUTAGE_JITTER * random.random())


@dataclass
class Failing:
    """The failed deliveries of one message in a row, as this worker saw them."""

    since: float  # monotonic time of the first
    count: int = 0  # all of them
    unexpected: int = 0  # those neither transient nor incurable


class Failures:
    """Failed deliveries per message (stream, sequence), for the bounds of ``fate``.

    Kept in memory, at most ``most`` messages (the oldest is forgotten first): a bound
    that a worker restart resets is still a bound, and it costs no write on the way."""

    def __init__(self, most: int = 10_000) -> None:
        self.most = most
        self._seen: OrderedDict[tuple[str, int], Failing] = OrderedDict()

    def failed(self, key: tuple[str, int], transient: bool) -> Failing:
        f = self._seen.pop(key, None) or Failing(since=time.monotonic())
        f.count += 1
        if not transient:
            f.unexpected += 1
        self._seen[key] = f
        while len(self._seen) > self.most:
            self._seen.popitem(last=False)
        return f

    def forget(self, key: tuple[str, int]) -> None:
        self._seen.pop(key, None)


FAILURES = Failures()


def fate(exc: Exception, failing: Failing) -> tuple[float | None, str]:
    """(delay before the next try, or None to dead-letter now; the reason to log)."""
    what = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, INCURABLE_ERRORS):
        return None, what
    if isinstance(exc, TRANSIENT_ERRORS) and not failing.unexpected:
        if time.monotonic() - failing.since >= TRANSIENT_FOR:
            return None, f"{what} (still failing after {failing.count} deliveries)"
        return outage_backoff(failing.count), what
    if failing.unexpected >= UNEXPECTED_TRIES:
        return None, f"{what} (failed {failing.unexpected} deliveries in a row)"
    return backoff(failing.count), what


async def dead_letter(rt: Runtime, msg: Msg, reason: str) -> None:
    """Keep the bad message, whole, beside its reason; then it is safe to term it.

    The copy's ``Nats-Msg-Id`` is its own (one dead letter however often the message is
    delivered before it is termed); the original's is kept as ``Jl-Dead-Msg-Id``."""
    meta = msg.metadata
    hdrs = dict(msg.headers or {})
    original_id = hdrs.get("Nats-Msg-Id")
    if original_id is not None:
        hdrs["Jl-Dead-Msg-Id"] = original_id
    hdrs.update(
        {
            "Nats-Msg-Id": f"dead.{meta.stream}.{meta.sequence.stream}",
            "Jl-Dead-Reason": reason[:1000],
            "Jl-Dead-Stream": meta.stream,
            "Jl-Dead-Sequence": str(meta.sequence.stream),
            "Jl-Dead-Subject": msg.subject,
        }
    )
    body = msg.data
    if message_size(body, hdrs) > rt.nc.max_payload:
        # The message fit, but not with the reason beside it: keep the reason, say so.
        hdrs["Jl-Dead-Body-Dropped"] = str(len(body))
        body = b""
    await rt.js.publish(dead_subject(msg.subject), body, headers=hdrs)


async def _heartbeats(d: Delivery, every: float) -> None:
    """Beat now, then every ``every`` seconds, until the lease is found lost."""
    while True:
        try:
            await d.heartbeat()
        except Exception as exc:  # an outage: the next beat tries again
            log.warning("step.heartbeat_failed", error=str(exc))
        if d.lost:
            log.warning("step.lease_lost")
            return
        await asyncio.sleep(every)


class Beats:
    """The heartbeat of a delivery, every ``every`` seconds while its handler runs. Its task
    is made when the first beat is due, not per delivery: most steps end well before."""

    def __init__(self, d: Delivery, every: float) -> None:
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(every, self._start, d, every)

    def _start(self, d: Delivery, every: float) -> None:
        self._task = asyncio.create_task(_heartbeats(d, every))

    async def stop(self) -> None:
        self._timer.cancel()
        task = self._task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def dispatch(rt: Runtime, msg: Msg, handler: Handler) -> None:
    hdrs = msg.headers or {}
    ids = start_step(
        session=hdrs.get(H_SESSION),
        turn=hdrs.get(H_TURN),
        step=hdrs.get(H_STEP) or hdrs.get("Nats-Msg-Id"),
        kind=hdrs.get(H_KIND),
        seq=msg.metadata.sequence.stream,
        delivery=msg.metadata.num_delivered,
    )
    d = Delivery(rt, msg)
    key = (msg.metadata.stream, msg.metadata.sequence.stream)
    kind = hdrs.get(H_KIND) or "unknown"
    if msg.metadata.num_delivered > 1:
        metrics.REDELIVERIES.labels(kind).inc()
    started = time.perf_counter()
    outcome = "error"
    beat = Beats(d, rt.lease_seconds / 3)
    try:
        try:
            await handler(d)
        finally:
            await beat.stop()
        if d.lost:
            raise TakenOver(d.fence_key or "?")
        await _let_go(rt, msg)
        # Not waited for: state already says the step is done, so an ack lost with a
        # restarting server only costs one more delivery, which finds it done and acks.
        await msg.ack()
        outcome = "acked"
        log.debug("step.acked")
    except TakenOver as exc:
        outcome = "taken_over"
        log.warning("step.taken_over", key=exc.key)
        await _let_go(rt, msg)  # another attempt owns the step now
    except RetryLater as exc:
        outcome = "retry_later"
        log.info("step.retry_later", delay=exc.delay, reason=exc.reason)
        await _hand_back(d, msg, exc.delay)
    except ClockOff as exc:
        # Nothing this process seals would be trusted: not the step's fault, so no failure
        # is counted; another worker takes it (this one takes no more while it is off).
        outcome = "clock_off"
        log.warning("step.handed_back", reason=str(exc))
        await _hand_back(d, msg, None)
    except NewerWriter as exc:
        # A newer jetloop's step, in a rolling upgrade: handed back for a worker that reads
        # it. A turn request is a client's: refused at once, or it would hold its session.
        age = time.time() - msg.metadata.timestamp.timestamp()
        if is_step_subject(msg.subject) and age < rt.newer_writer_seconds:
            outcome = "newer_writer"
            log.info("step.newer_writer", reason=str(exc), age=round(age, 1))
            await _hand_back(d, msg, NEWER_WRITER_RETRY)
        else:
            outcome = "dead_letter"
            reason = str(exc)
            if is_step_subject(msg.subject):
                reason += f": no worker that reads it took it in {rt.newer_writer_seconds:g} s"
            await _dead_letter(rt, msg, reason)
    except (DeadLetter, DecodeError) as exc:
        outcome = "dead_letter"
        reason = exc.reason if isinstance(exc, DeadLetter) else str(exc)
        await _dead_letter(rt, msg, reason)
    except asyncio.CancelledError:
        # Shutdown past the drain timeout: hand the work back now rather than at ack-wait.
        # (Still listed as held: if this process dies before the next list, a rescuer hands
        # the step on at once; the nak does the same while it lives.)
        if not d.lost:
            await _quietly(msg.nak())
        raise
    except Exception as exc:
        failing = FAILURES.failed(key, transient=isinstance(exc, TRANSIENT_ERRORS))
        delay, reason = fate(exc, failing)
        if d.lost:
            log.warning("step.error_after_takeover", error=reason)
        elif delay is None:
            outcome = "dead_letter"
            log.exception("step.error", error=reason, retry=False)
            if await _dead_letter(rt, msg, reason):
                await _fail_its_turn(rt, msg, reason)
        else:
            if isinstance(exc, TRANSIENT_ERRORS):
                # An outage or a lost race, tried again: a server restart makes a few of
                # these in every worker; not an error of the step (nor its traceback).
                log.warning("step.error", error=reason, retry_in=delay, transient=True)
            else:
                log.exception("step.error", error=reason, retry_in=delay)
            await _let_go(rt, msg)
            await _quietly(msg.nak(delay=delay))
    finally:
        d.release()
        if outcome != "error":
            FAILURES.forget(key)
        metrics.step_done(kind, outcome, time.perf_counter() - started)
        end_step(ids)


async def _hand_back(d: Delivery, msg: Msg, delay: float | None) -> None:
    """Give the message back to be delivered again (after ``delay``), unless this attempt
    lost its claim meanwhile: then the message is another attempt's, and a nak from here
    would redeliver it under that attempt (JetStream does not fence naks): nothing is sent."""
    await _let_go(d.rt, msg)
    if d.lost:
        log.warning("step.taken_over", key=d.fence_key or "?")
        return
    await _quietly(msg.nak(delay=delay))


async def _let_go(rt: Runtime, msg: Msg) -> None:
    """This process is about to settle ``msg``: take it off the list a rescuer would read (the
    next list sent leaves it out; ``jetloop.streams.holds``)."""
    if rt.holds is not None:
        rt.holds.drop(msg)


async def _dead_letter(rt: Runtime, msg: Msg, reason: str) -> bool:
    """Move ``msg`` to ``JL_DEAD`` with ``reason``; False when it could not be stored (the
    message is then kept, and tried again later)."""
    log.error("step.dead_letter", reason=reason)
    try:
        await dead_letter(rt, msg, reason)
    except Exception as pub_exc:
        # Not stored in JL_DEAD yet: keep the message and try again later.
        log.error("step.dead_letter_failed", error=str(pub_exc))
        await _quietly(msg.nak(delay=backoff(msg.metadata.num_delivered)))
        return False
    await _let_go(rt, msg)
    await _quietly(msg.term())
    return True


# How much of a failure's text a turn's error keeps (the dead letter has all of it).
REASON_CHARS = 500


async def _fail_its_turn(rt: Runtime, msg: Msg, reason: str) -> None:
    """A step that no retry can cure (past the size limit, a bug) was dead-lettered: its turn
    would wait for it for ever, so it fails with the reason (``close_turn`` settles its calls
    and moves the session on), and the caller's wait returns. Not for a message the handler
    refused as not belonging to the turn (``DeadLetter``: a stale or stray step), nor for
    ``close_turn`` itself; a turn that ended meanwhile is left as it is."""
    hdrs = msg.headers or {}
    sid, tid, kind = hdrs.get(H_SESSION), hdrs.get(H_TURN), hdrs.get(H_KIND)
    if msg.metadata.stream != STEPS_STREAM or not (sid and tid):
        return
    if kind == StepKind.CLOSE_TURN.value:
        return
    step = hdrs.get(H_STEP) or hdrs.get("Nats-Msg-Id") or "?"
    short = reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS] + "…"
    audit = Event.of(
        StepDeadLetteredData(step=step, reason=short, dead_letter=dead_subject(msg.subject)),
        key=f"{sid}.{tid}.dead.{step}",
        session_id=sid,
        turn_id=tid,
    )
    for _ in range(3):
        try:
            found = await rt.state.turn(sid, tid)
            if found is None or found.value.status.terminal:
                return
            await fail_turn(rt, found.value, found.revision, f"step {step} failed: {short}", audit)
            return
        except RetryLater:
            continue  # the turn moved meanwhile: read it again
        except Exception as exc:  # the dead letter is kept; an operator can still close it
            log.error("step.turn_not_failed", error=repr(exc))
            return


async def _quietly(op: Awaitable[None]) -> None:
    try:
        await op
    except Exception as exc:  # a lost nak/term only means redelivery at ack-wait
        log.warning("step.settle_failed", error=str(exc))
