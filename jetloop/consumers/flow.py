"""Flow control of model calls: what a model step asks before it calls its provider, and what
it gives back after.

Three limits, each shared by every worker through NATS (``jetloop.streams.pauses``,
``jetloop.streams.windows``):

- a **pause**: a provider that answered 429 with ``Retry-After`` is not called by any worker
  until then (``Admission.throttled`` sets it; ``admit`` refuses while it lasts);
- a **window**: an endpoint's requests and tokens per window (``JETLOOP_PROVIDER_LIMITS``),
  counted when admitted and settled with the tokens the call used;
- **slots**: an endpoint's calls in flight, taken after the step's claim (a slot names the
  attempt that holds it, so a slot whose attempt is gone is found stale and taken).

Each refusal is a ``RetryLater`` with the wait, raised before the step's attempt is used;
what the step records about the attempt (an attempt handed back unused) is the step's own
(``jetloop.consumers.run_model``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from jetloop.consumers.errors import RetryLater
from jetloop.consumers.runtime import Runtime
from jetloop.consumers.usage import model_of
from jetloop.schemas.errors import ProviderRetryable
from jetloop.streams.pauses import pause_key
from jetloop.streams.windows import Admitted, EndpointLimits, Slot

log = structlog.get_logger("jetloop.flow")


@dataclass
class Admission:
    """A model call let through: what it holds until ``close``."""

    rt: Runtime
    model: object  # the agent's model adapter
    endpoint: str | None
    limits: EndpointLimits | None
    admitted: Admitted
    slot: Slot | None = None
    used: int | None = None  # the call's tokens, once it answered

    async def take_slot(self, holder: dict[str, Any]) -> bool:
        """After the claim: one of the endpoint's slots of calls in flight, for the attempt
        ``holder`` names; False when every slot is in use (True when the endpoint has none)."""
        limits = self.limits
        if limits is None or limits.concurrent is None or self.endpoint is None:
            return True
        self.slot = await self.rt.windows.take_slot(
            self.endpoint, limits, holder, _still_held(self.rt)
        )
        return self.slot is not None

    async def throttled(self, exc: ProviderRetryable, wait: float) -> None:
        """The provider said to wait ``wait`` seconds (a 429): every worker waits as long."""
        log.warning("model.throttled", retry_after=wait, error=str(exc))
        await self.rt.pauses.pause(
            self.endpoint,
            wait,
            {"provider": exc.provider, "model": model_of(self.model), "by": self.rt.worker_id},
        )

    async def close(self) -> None:
        """The call ended (answered, failed or never made): its window counts what it used,
        its slot is free."""
        await self.rt.windows.settle(self.admitted, self.used)
        if self.slot is not None:
            await self.rt.windows.free_slot(self.slot)


async def admit(rt: Runtime, model: object) -> Admission:
    """Before the claim: ``RetryLater`` while the provider asked every worker to wait, or
    while the endpoint's window is full; else the call is counted in its window."""
    endpoint = pause_key(model)
    paused = rt.pauses.remaining(endpoint)
    if paused > 0:
        raise RetryLater(paused, f"the model provider asked to wait {paused:.1f}s more")
    limits = rt.limits_of(model)
    admitted = Admitted("", 0)
    if limits is not None and endpoint is not None:
        got = await rt.windows.admit(endpoint, limits)
        if not isinstance(got, Admitted):
            raise RetryLater(got, "the model endpoint's limit for this window is reached")
        admitted = got
    return Admission(rt, model, endpoint, limits, admitted)


def _still_held(rt: Runtime) -> Callable[[dict[str, Any]], Awaitable[bool]]:
    """Whether the attempt a slot names still holds its model step (its turn record says
    so): otherwise the slot is stale, and another call may take it."""

    async def held(holder: dict[str, Any]) -> bool:
        found = await rt.state.turn(str(holder.get("session")), str(holder.get("turn")))
        attempt = found.value.attempt if found is not None else None
        return (
            attempt is not None
            and attempt.incarnation == holder.get("incarnation")
            and attempt.no == holder.get("no")
        )

    return held
