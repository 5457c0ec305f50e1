"""Publishing with identity: every message carries its ``Nats-Msg-Id`` and readable headers.

One place builds headers and publishes steps, events and history entries, so there is one
way to publish a step (docs/design.md, convention 2: no second copy of a mechanism). A step's
subject and key come from its kind's row in ``jetloop.schemas.kinds``. Pipelined publishes go
out together and their answers are awaited together, under one timeout (``streams.replies``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nats.js import JetStreamContext

from jetloop.schemas import (
    SCHEMA_VERSION,
    WIRE_OF_KIND,
    Event,
    HistoryEntry,
    StepMessage,
    encode,
)
from jetloop.schemas.kinds import Pool, Scope
from jetloop.schemas.log import H_EVENTS
from jetloop.streams.connection import retrying
from jetloop.streams.replies import connection_of, replies_of
from jetloop.streams.topology import event_subject, history_subject, step_subject

H_KIND = "Jl-Kind"
H_AGENT = "Jl-Agent"
H_SESSION = "Jl-Session"
H_TURN = "Jl-Turn"
H_STEP = "Jl-Step"
H_SCHEMA = "Jl-Schema"
H_MSG_ID = "Nats-Msg-Id"
# On a rescuer's copy of a message a dead process held: that process's incarnation.
H_HOLDER_LOST = "Jl-Holder-Lost"


@dataclass(frozen=True)
class Outgoing:
    subject: str
    body: bytes
    headers: dict[str, str]


def headers(kind: str, session_id: str, turn_id: str | None, key: str) -> dict[str, str]:
    h = {
        H_MSG_ID: key,
        H_KIND: kind,
        H_SESSION: session_id,
        H_STEP: key,
        H_SCHEMA: str(SCHEMA_VERSION),
    }
    if turn_id:
        h[H_TURN] = turn_id
    return h


def subject_of(step: StepMessage) -> str:
    """The step's subject: the pool of its kind (``WIRE_OF_KIND``), or of a call's tool served
    by a pool of its own (``StepMessage.pool``), then its agent, kind, session."""
    wire = WIRE_OF_KIND[step.kind]
    pool = wire.pool.value
    if step.pool is not None and wire.pool is Pool.TOOL and wire.scope is Scope.CALL:
        pool = step.pool
    return step_subject(pool, step.agent, step.kind.value, step.session_id)


def step_out(step: StepMessage) -> Outgoing:
    key = step.step_key()
    return Outgoing(
        subject=subject_of(step),
        body=encode(step),
        headers={
            **headers(step.kind.value, step.session_id, step.turn_id, key),
            H_AGENT: step.agent,
        },
    )


def event_out(event: Event) -> Outgoing:
    return Outgoing(
        subject=event_subject(event.session_id, event.type.value),
        body=encode(event),
        headers=headers(event.type.value, event.session_id, event.turn_id, event.key),
    )


def history_out(session_id: str, entry: HistoryEntry) -> Outgoing:
    h = headers(f"history.{entry.role.value}", session_id, entry.turn_id, entry.key)
    if entry.events:
        # The folded log (jetloop.schemas.log): the event types the entry carries.
        h[H_EVENTS] = " ".join(dict.fromkeys(e.type.value for e in entry.events))
    return Outgoing(
        subject=history_subject(session_id, entry.role.value),
        body=encode(entry),
        headers=h,
    )


class Bus:
    """The publisher of steps, events and history: idempotent by ``Nats-Msg-Id``."""

    def __init__(self, js: JetStreamContext, timeout: float = 5.0, retry_for: float = 10.0) -> None:
        self.js = js
        self._replies = replies_of(connection_of(js))
        self.timeout = timeout
        self.retry_for = retry_for

    async def publish(self, out: Sequence[Outgoing]) -> None:
        """Publish in order; all are confirmed (PubAck) before this returns.

        Every message carries its ``Nats-Msg-Id``, so a publish whose answer was lost in a
        restart or an election is simply sent again: the stream drops the duplicate.
        """
        if not out:
            return
        await retrying(lambda: self._publish(out), self.retry_for, "publish")

    async def _publish(self, out: Sequence[Outgoing]) -> None:
        await self._replies.publish_all(
            [(o.subject, o.body, dict(o.headers)) for o in out], self.timeout
        )
