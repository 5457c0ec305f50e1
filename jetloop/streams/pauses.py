"""Provider pauses shared by every worker: a 429's ``Retry-After`` slows them all.

When a model provider answers a worker "too many requests, retry after N seconds", that
worker writes ``pause.<provider>.<endpoint>`` in the ``jl_limits`` bucket: until when the
provider asked to be left alone (the later of what is there and what it was told). Every
worker watches the bucket and keeps the pauses in memory, so checking one before a model
call costs no round trip; a model step that finds its provider paused is handed back for
the rest of the pause without being tried (``jetloop.consumers.run_model``). The endpoint is
the adapter's base URL and model, hashed into a key (a provider's limits are per key and
model); the value also names them in clear, for ``nats kv get``.

A watch learns of a pause within a round trip or two; a worker that calls in that moment
meets the 429 itself, and pauses like the first.

The watch is a pull consumer of the worker's own, made through the API only a worker may use
and checked every ``CHECK_EVERY`` seconds against the server's answer to its create
(``jetloop.streams.consumer_guard``): a role below ``worker`` may update any consumer by
naming it in an ephemeral create, e.g. to leave the values out or filter out the pauses. One
that differs, or a value delivered without its body, has the watch made again at once, from
each key's last value, so no pause is missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import secrets
import time
from typing import Any

import structlog
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from jetloop.streams import consumer_guard
from jetloop.streams.intake import Intake
from jetloop.streams.topology import LIMITS_BUCKET

log = structlog.get_logger("jetloop.pauses")

PREFIX = "pause."
STREAM = f"KV_{LIMITS_BUCKET}"
SUBJECTS = f"$KV.{LIMITS_BUCKET}."
CHECK_EVERY = 2.0  # seconds between looks at the watch's consumer


def pause_key(adapter: Any) -> str | None:
    """The key of the endpoint ``adapter`` calls (provider, base URL, model), or None for an
    adapter that does not say (a scripted model, a framework's own)."""
    provider = getattr(adapter, "provider", None)
    base_url = getattr(adapter, "base_url", None)
    model = getattr(adapter, "model", None)
    if not all(isinstance(x, str) and x for x in (provider, base_url, model)):
        return None
    return _key(str(provider), str(base_url), str(model))


@functools.lru_cache(maxsize=256)
def _key(provider: str, base_url: str, model: str) -> str:
    token = "".join(c if c.isalnum() or c in "-_" else "_" for c in provider)
    digest = hashlib.sha256(f"{base_url}|{model}".encode()).hexdigest()[:16]
    return f"{PREFIX}{token}.{digest}"


class Pauses:
    """The pauses of ``jl_limits``, as this worker last heard them."""

    def __init__(self, kv: KeyValue | None = None, js: JetStreamContext | None = None) -> None:
        self.kv = kv
        self.js = js
        self.until: dict[str, float] = {}
        # The watch's consumer now (None: not made yet, or being made again).
        self.watching: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @classmethod
    async def open(cls, js: JetStreamContext) -> Pauses:
        pauses = cls(await js.key_value(LIMITS_BUCKET), js)
        pauses._task = asyncio.create_task(pauses._follow(), name="jetloop-pauses")
        return pauses

    async def close(self) -> None:
        """Stop following. Cancelled again while it runs on: a cancel can be lost in a wait
        that ends as it comes (``asyncio.wait_for`` in Python 3.11, also inside nats-py), and
        a stop must not hang on it (a worker's stop did, until its supervisor gave up)."""
        task = self._task
        if task is None:
            return
        self._closed = True
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        with contextlib.suppress(asyncio.CancelledError, Exception):
            task.result()

    def remaining(self, key: str | None) -> float:
        """Seconds the endpoint of ``key`` is still paused (0: not paused)."""
        if key is None:
            return 0.0
        return max(0.0, self.until.get(key, 0.0) - time.time())

    async def pause(self, key: str | None, seconds: float, what: dict[str, Any]) -> None:
        """Pause the endpoint of ``key`` for ``seconds`` from now, for every worker (kept if a
        longer pause is there already). A write that fails leaves the pause to this worker."""
        if key is None:
            return
        until = time.time() + seconds
        self.until[key] = max(self.until.get(key, 0.0), until)
        if self.kv is None:
            return
        body = json.dumps({"until": until, **what}).encode()
        for _ in range(5):
            try:
                try:
                    entry = await self.kv.get(key)
                except KeyNotFoundError:
                    await self.kv.create(key, body)
                    return
                if entry.value and json.loads(entry.value).get("until", 0) >= until:
                    return
                await self.kv.update(key, body, last=entry.revision)
                return
            except KeyWrongLastSequenceError:
                continue  # another worker paused it meanwhile: read again
            except (NatsError, TimeoutError, ValueError) as exc:
                log.warning("pause.not_shared", key=key, error=str(exc))
                return

    async def _follow(self) -> None:
        assert self.js is not None
        while not self._closed:
            try:
                await self._watch(self.js)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # an outage: watch again
                log.debug("pause.watch_lost", error=str(exc))
                await asyncio.sleep(1.0)

    async def _watch(self, js: JetStreamContext) -> None:
        """Follow the pauses through a consumer of this worker's until it is found changed
        (then return: made again by the caller) or the connection fails (raise)."""
        nc = js._nc  # the context's connection: nats-py gives it no public name
        name = f"jl_pauses_{secrets.token_hex(8)}"
        made = await consumer_guard.make(
            nc,
            STREAM,
            {
                "name": name,
                "filter_subject": f"{SUBJECTS}{PREFIX}>",
                "deliver_policy": "last_per_subject",
                "ack_policy": "none",
                "inactive_threshold": int(5e9),
            },
        )
        intake = Intake(nc, STREAM, name)
        intake._js = js  # deleted again when the watch ends
        await intake.start()
        self.watching = name
        try:
            checked = time.monotonic()
            while not self._closed:
                again = False
                for m in await intake.take(64, timeout=1.0):
                    if consumer_guard.stripped(m):
                        again = True  # its value left out: read it again, whole
                    elif m.data:
                        self._heard(m.subject.removeprefix(SUBJECTS), m.data)
                if again or time.monotonic() - checked >= CHECK_EVERY:
                    checked = time.monotonic()
                    now = await consumer_guard.current(nc, STREAM, name)
                    fields = ["(gone)"] if now is None else consumer_guard.changed(made, now)
                    if again or fields:
                        log.warning("pause.watch_changed", consumer=name, fields=fields)
                        return
        finally:
            self.watching = None
            await intake.stop()

    def _heard(self, key: str, value: bytes) -> None:
        try:
            until = float(json.loads(value)["until"])
        except (ValueError, KeyError, TypeError):
            return
        if until > self.until.get(key, 0.0) or key not in self.until:
            log.info("pause.heard", key=key, seconds=round(until - time.time(), 3))
        self.until[key] = max(self.until.get(key, 0.0), until)
