"""The one place a message's fate is decided (STYLE rule 4).

A handler returns (ack) or raises a ``StepOutcome``; ``dispatch`` acks, naks, terms or
dead-letters accordingly, and runs the heartbeat while the handler works. No handler calls
``ack()`` itself. A taken-over attempt sends nothing at all on its message: JetStream does
not fence late acks, so an ack from a stale worker could settle the live worker's delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import structlog
from nats.aio.msg import Msg

from consumers import metrics
from consumers.errors import DeadLetter, RetryLater, TakenOver
from consumers.runtime import Delivery, Runtime
from schemas import DecodeError
from streams.bus import H_KIND, H_SESSION, H_STEP, H_TURN
from streams.topology import dead_subject

log = structlog.get_logger("jetloop.dispatch")

Handler = Callable[[Delivery], Awaitable[None]]

MAX_BACKOFF = 30.0


def backoff(num_delivered: int) -> float:
    return float(min(MAX_BACKOFF, 0.2 * 2 ** min(num_delivered - 1, 8)))


async def dead_letter(rt: Runtime, msg: Msg, reason: str) -> None:
    """Keep the bad message, whole, beside its reason; then it is safe to term it."""
    meta = msg.metadata
    hdrs = dict(msg.headers or {})
    hdrs.update(
        {
            "Nats-Msg-Id": f"dead.{meta.stream}.{meta.sequence.stream}",
            "Jl-Dead-Reason": reason[:1000],
            "Jl-Dead-Stream": meta.stream,
            "Jl-Dead-Sequence": str(meta.sequence.stream),
            "Jl-Dead-Subject": msg.subject,
        }
    )
    await rt.js.publish(dead_subject(msg.subject), msg.data, headers=hdrs)


async def _heartbeats(d: Delivery, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            await d.heartbeat()
        except Exception as exc:  # an outage: the next beat tries again
            log.warning("step.heartbeat_failed", error=str(exc))
        if d.lost:
            log.warning("step.lease_lost")
            return


async def dispatch(rt: Runtime, msg: Msg, handler: Handler) -> None:
    hdrs = msg.headers or {}
    structlog.contextvars.bind_contextvars(
        session=hdrs.get(H_SESSION),
        turn=hdrs.get(H_TURN),
        step=hdrs.get(H_STEP) or hdrs.get("Nats-Msg-Id"),
        kind=hdrs.get(H_KIND),
        seq=msg.metadata.sequence.stream,
        delivery=msg.metadata.num_delivered,
    )
    d = Delivery(rt, msg)
    kind = hdrs.get(H_KIND) or "unknown"
    if msg.metadata.num_delivered > 1:
        metrics.REDELIVERIES.labels(kind).inc()
    started = time.perf_counter()
    outcome = "error"
    beat = asyncio.create_task(_heartbeats(d, rt.lease_seconds / 3))
    try:
        try:
            await handler(d)
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
        if d.lost:
            raise TakenOver(d.fence_key or "?")
        await msg.ack_sync(timeout=5)
        outcome = "acked"
        log.debug("step.acked")
    except TakenOver as exc:
        outcome = "taken_over"
        log.warning("step.taken_over", key=exc.key)
    except RetryLater as exc:
        outcome = "retry_later"
        log.info("step.retry_later", delay=exc.delay, reason=exc.reason)
        await _quietly(msg.nak(delay=exc.delay))
    except (DeadLetter, DecodeError) as exc:
        outcome = "dead_letter"
        reason = exc.reason if isinstance(exc, DeadLetter) else str(exc)
        log.error("step.dead_letter", reason=reason)
        try:
            await dead_letter(rt, msg, reason)
        except Exception as pub_exc:
            # Not stored in JL_DEAD yet: keep the message and try again later.
            log.error("step.dead_letter_failed", error=str(pub_exc))
            await _quietly(msg.nak(delay=backoff(msg.metadata.num_delivered)))
        else:
            await _quietly(msg.term())
    except asyncio.CancelledError:
        # Shutdown past the drain timeout: hand the work back now rather than at ack-wait.
        if not d.lost:
            await _quietly(msg.nak())
        raise
    except Exception as exc:
        delay = backoff(msg.metadata.num_delivered)
        log.exception("step.error", error=str(exc), retry_in=delay)
        if not d.lost:
            await _quietly(msg.nak(delay=delay))
    finally:
        metrics.STEPS.labels(kind, outcome).inc()
        metrics.STEP_SECONDS.labels(kind).observe(time.perf_counter() - started)
        structlog.contextvars.clear_contextvars()


async def _quietly(op: Awaitable[None]) -> None:
    try:
        await op
    except Exception as exc:  # a lost nak/term only means redelivery at ack-wait
        log.warning("step.settle_failed", error=str(exc))
