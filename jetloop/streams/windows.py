"""Per-window request and token limits on a model endpoint, shared by every worker.

``JETLOOP_PROVIDER_LIMITS`` gives an endpoint (``provider:model`` or a model name) at most
``requests_per_minute`` calls and ``tokens_per_minute`` tokens (input + output) per window
(``window_seconds``, 60 by default). The count of the window now is one key in ``jl_limits``,
``window.<provider>.<endpoint>.<window number>``, changed by compare-and-set only: before its
call a model step *admits* it — one more request, and ``reserve_tokens`` tokens set aside —
if both still fit, and is handed back unclaimed to the next window if not; after the call it
*settles*: the reservation is replaced by the tokens the call used (released whole when the
call failed). The token limit therefore holds as long as no call uses more than
``reserve_tokens``: set it to the most one call of that endpoint uses (its ``max_tokens``
plus a prompt). A worker that dies between the two leaves its reservation counted, which
errs on the side of the provider. Windows expire with the bucket's TTL.

``concurrent`` caps the calls in flight: ``slot.<provider>.<endpoint>.<i>`` for i below it,
each created by the attempt that takes it (it names the turn, the worker's incarnation and
the attempt) and deleted when the call ends. A slot whose attempt no longer holds its step
(the turn record says so: the call answered, or the step was taken over from a dead worker)
is taken over by compare-and-set, so a crash never leaks one for longer than the step's
lease.

Cost: two compare-and-set writes per model call of a limited endpoint (each a read and a
write); none for an endpoint without limits.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from nats.errors import Error as NatsError
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from pydantic import BaseModel, ConfigDict, Field

log = structlog.get_logger("jetloop.windows")

TRIES = 10


class EndpointLimits(BaseModel):
    """What every worker together may send one model endpoint per window."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Calls in flight at once, every worker together (a slot each, held from the step's
    # claim to its answer).
    concurrent: int | None = Field(None, ge=1, le=1000)
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    # Set aside for each call until it answers: the most one call uses (input + output).
    reserve_tokens: int = Field(4096, ge=1)
    # The window the "per minute" limits count in (shorter windows: for tests).
    window_seconds: float = Field(60.0, ge=1.0)


@dataclass(frozen=True)
class Slot:
    """A slot held for a call in flight: its key and the revision this attempt wrote."""

    key: str
    revision: int


@dataclass(frozen=True)
class Admitted:
    """A call let through: the window it counts in and what it set aside."""

    key: str
    reserved: int


class Windows:
    """The shared windows of ``jl_limits`` (no bucket: every call is admitted)."""

    def __init__(self, kv: KeyValue | None = None) -> None:
        self.kv = kv

    async def admit(self, endpoint: str, limits: EndpointLimits) -> Admitted | float:
        """Let one call through now (``Admitted``), or the seconds until the next window."""
        if self.kv is None:
            return Admitted("", 0)
        now = time.time()
        number = int(now // limits.window_seconds)
        key = f"window.{endpoint.removeprefix('pause.')}.{number}"
        wait = (number + 1) * limits.window_seconds - now
        reserve = limits.reserve_tokens if limits.tokens_per_minute is not None else 0
        for _ in range(TRIES):
            try:
                count, revision = await self._read(key)
                requests, tokens = count.get("requests", 0), count.get("tokens", 0)
                rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
                if rpm is not None and requests + 1 > rpm:
                    return wait
                # A window's first call always goes (a reservation larger than the limit
                # would otherwise never run).
                if tpm is not None and requests and tokens + reserve > tpm:
                    return wait
                body = json.dumps({"requests": requests + 1, "tokens": tokens + reserve})
                if await self._write(key, body.encode(), revision):
                    return Admitted(key, reserve)
            except (NatsError, TimeoutError) as exc:
                log.warning("window.unavailable", key=key, error=str(exc))
                return Admitted("", 0)  # an outage: the provider's own 429 still guards it
        return 0.2  # contended: try again shortly

    async def settle(self, admitted: Admitted, used: int | None) -> None:
        """The call ended: its reservation becomes the tokens it used (None: it failed)."""
        if self.kv is None or not admitted.key or not admitted.reserved:
            return
        change = (used or 0) - admitted.reserved
        for _ in range(TRIES):
            try:
                count, revision = await self._read(admitted.key)
                count["tokens"] = max(0, count.get("tokens", 0) + change)
                if await self._write(admitted.key, json.dumps(count).encode(), revision):
                    return
            except (NatsError, TimeoutError) as exc:
                log.warning("window.not_settled", key=admitted.key, error=str(exc))
                return

    async def take_slot(
        self,
        endpoint: str,
        limits: EndpointLimits,
        holder: dict[str, Any],
        still_held: Callable[[dict[str, Any]], Awaitable[bool]],
    ) -> Slot | None:
        """One of the endpoint's ``concurrent`` slots for the attempt ``holder`` names (its
        turn, incarnation and attempt number), or None when all are held. A slot whose holder
        ``still_held`` says no longer holds its step (the call answered, failed, or was taken
        over from a dead worker) is taken over by compare-and-set."""
        if self.kv is None or limits.concurrent is None:
            return Slot("", 0)
        base = f"slot.{endpoint.removeprefix('pause.')}"
        body = json.dumps(holder).encode()
        held: list[tuple[str, dict[str, Any], int]] = []
        try:
            for i in range(limits.concurrent):
                key = f"{base}.{i}"
                try:
                    return Slot(key, await self.kv.create(key, body))
                except KeyWrongLastSequenceError:
                    pass
                try:
                    entry = await self.kv.get(key)
                except KeyNotFoundError:
                    continue  # released meanwhile: the next admission takes it
                held.append((key, json.loads(entry.value or b"{}"), entry.revision or 0))
            for key, value, revision in held:
                if await still_held(value):
                    continue
                try:
                    return Slot(key, await self.kv.update(key, body, last=revision))
                except KeyWrongLastSequenceError:
                    continue  # another worker took it first
        except (NatsError, TimeoutError) as exc:
            log.warning("slot.unavailable", endpoint=endpoint, error=str(exc))
            return Slot("", 0)  # an outage: the provider's own 429 still guards it
        return None

    async def free_slot(self, slot: Slot) -> None:
        """Give the slot back (only if it is still this attempt's)."""
        if self.kv is None or not slot.key:
            return
        try:
            await self.kv.delete(slot.key, last=slot.revision)
        except (NatsError, TimeoutError, KeyWrongLastSequenceError):
            pass  # taken over, or no server now: the next admission finds it stale

    async def _read(self, key: str) -> tuple[dict[str, int], int | None]:
        assert self.kv is not None
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            return {}, None
        return json.loads(entry.value or b"{}"), entry.revision

    async def _write(self, key: str, body: bytes, revision: int | None) -> bool:
        assert self.kv is not None
        try:
            if revision is None:
                await self.kv.create(key, body)
            else:
                await self.kv.update(key, body, last=revision)
        except KeyWrongLastSequenceError:
            return False
        return True
