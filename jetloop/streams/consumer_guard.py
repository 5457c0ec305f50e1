"""jetloop's own consumers on streams that every role may read: kept as made, and kept room for.

A role below ``worker`` may make ephemeral consumers on the streams that are not work queues
(``jetloop.services.natsauth``), and nats-server takes a consumer's *name* in the body of
such a create and then updates the consumer so named, durable or not. Two things follow,
and this module holds jetloop's answer to both:

- **A consumer jetloop keeps can be changed under it** (``headers_only``, another filter, a
  smaller ``max_ack_pending``, …). ``make`` creates a consumer through the raw API and keeps
  the server's whole answer (every field, the server's defaults filled in, fields nats-py
  does not know included); ``changed`` compares that with what the server holds now. A
  consumer that differs is made again by its owner (the projector, the pause watcher), and
  a delivery that came without its body (``stripped``) is never taken as the message.
- **The consumers of a stream are counted against one limit**: nats-server (2.15) refuses
  the 1001st consumer of a stream that sets no ``max_consumers`` (``default_max_consumers``,
  1000 unless the server's config says otherwise), whoever made them. One client making
  1000 ephemerals with a long inactive threshold would lock the gateway's live views out of
  ``JL_EVENTS`` for that long. ``sweep`` (run by every worker, ``guard_consumers``) deletes,
  once a stream holds ``SWEEP_AT`` consumers, those that are not jetloop's durables down to
  ``SWEEP_TO``: idle ones first (no pull waiting, no push subscriber, least recently active
  first), then the newest. A live view whose consumer is swept makes it again (it checks
  that its consumer is alive when quiet); a flood goes on costing the flooder its work.

Rule kept: "Keys are given, not guessed" (docs/design.md) — a consumer's config is the one
jetloop wrote, read back whole, never assumed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import structlog
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from jetloop.streams import topology

log = structlog.get_logger("jetloop.consumers")

API = "$JS.API"
# nats-server's default cap of consumers per stream (2.15: ``JSDefaultMaxConsumersPerStream``,
# changed by ``jetstream { limits { default_max_consumers } }``), and the counts at which a
# sweep starts and where it stops: room for the live views before the cap is met.
SERVER_LIMIT = 1000
SWEEP_AT = 800
SWEEP_TO = 600
SWEEP_EVERY = 2.0
# Set by nats-server on a delivery of a ``headers_only`` consumer: the body it left out.
BODY_LEFT_OUT = "Nats-Msg-Size"


class ConsumerError(NatsError):
    """The server refused to make or read a consumer (its API error, verbatim); a NATS
    error, so that callers treat it as they treat the server's other refusals."""

    def __init__(self, stream: str, name: str, error: dict[str, Any]) -> None:
        super().__init__(f"consumer {name} of {stream}: {error.get('description', error)}")
        self.stream = stream
        self.name = name
        self.err_code = error.get("err_code")


async def _api(nc: Nats, subject: str, body: dict[str, Any] | None, timeout: float) -> Any:
    answer = await nc.request(subject, json.dumps(body).encode() if body else b"", timeout)
    return json.loads(answer.data)


async def make(
    nc: Nats, stream: str, config: dict[str, Any], timeout: float = 5.0
) -> dict[str, Any]:
    """Create (or update) the consumer ``config["name"]`` of ``stream`` on the named subject
    (only a worker may use it) and return its config as the server holds it."""
    name = config["name"]
    subject = f"{API}.CONSUMER.CREATE.{stream}.{name}"
    data = await _api(nc, subject, {"stream_name": stream, "config": config}, timeout)
    if "error" in data:
        raise ConsumerError(stream, name, data["error"])
    made: dict[str, Any] = data["config"]
    wrong = [k for k, v in config.items() if made.get(k) != v]
    if wrong:
        # Someone updated it between our create and its answer, or the server would not
        # take a field: either way it is not the consumer asked for.
        raise ConsumerError(stream, name, {"description": f"made with other {', '.join(wrong)}"})
    return made


async def current(nc: Nats, stream: str, name: str, timeout: float = 5.0) -> dict[str, Any] | None:
    """The consumer's config as the server holds it now, every field (None: no such consumer).
    Raises ``NatsError``/``TimeoutError`` when it cannot be told now."""
    data = await _api(nc, f"{API}.CONSUMER.INFO.{stream}.{name}", None, timeout)
    if "error" in data:
        if data["error"].get("code") == 404:
            return None
        raise ConsumerError(stream, name, data["error"])
    config: dict[str, Any] = data["config"]
    return config


def changed(made: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The fields in which ``now`` differs from ``made`` (added and removed ones included)."""
    return sorted(k for k in made.keys() | now.keys() if made.get(k) != now.get(k))


def stripped(msg: Msg) -> bool:
    """Whether a delivery came without its body (its consumer was made ``headers_only``)."""
    return bool(msg.headers and BODY_LEFT_OUT in msg.headers)


# --- room for the live views ----------------------------------------------------------


def _when(text: str | None) -> float:
    """Seconds since the epoch of a server time (RFC 3339, nanoseconds); 0 when absent."""
    if not text or text.startswith("0001-"):
        return 0.0
    head, _, frac = text.rstrip("Z").partition(".")
    try:
        at = datetime.fromisoformat(head + "+00:00").timestamp()
    except ValueError:
        return 0.0
    return at + (float(f"0.{frac}") if frac.isdigit() else 0.0)


def _last_active(info: dict[str, Any]) -> float:
    return max(
        _when(info.get("created")),
        _when((info.get("delivered") or {}).get("last_active")),
        _when((info.get("ack_floor") or {}).get("last_active")),
    )


def _ours(stream: str, info: dict[str, Any]) -> bool:
    """Whether the consumer is jetloop's own: a durable, which below ``worker`` no role may
    make but on the blob store's stream, where jetloop keeps none."""
    durable = bool((info.get("config") or {}).get("durable_name"))
    return durable and not stream.startswith("OBJ_")


def victims(stream: str, infos: Sequence[dict[str, Any]], keep: int) -> list[str]:
    """Names of the consumers to delete so that ``keep`` remain: never jetloop's own; idle
    ones first (no pull waiting, no push subscriber), least recently active first; then the
    newest (a flood refilled is newer than a live view that has been open)."""
    extra = len(infos) - keep
    if extra <= 0:
        return []
    theirs = [i for i in infos if not _ours(stream, i)]

    def idle(i: dict[str, Any]) -> bool:
        return not i.get("num_waiting") and not i.get("push_bound")

    quiet = sorted((i for i in theirs if idle(i)), key=_last_active)
    busy = sorted((i for i in theirs if not idle(i)), key=lambda i: -_when(i.get("created")))
    return [str(i["name"]) for i in [*quiet, *busy][:extra]]


async def _listed(nc: Nats, stream: str, timeout: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    while True:
        data = await _api(nc, f"{API}.CONSUMER.LIST.{stream}", {"offset": len(out)}, timeout)
        if "error" in data:
            raise ConsumerError(stream, "*", data["error"])
        page = data.get("consumers") or []
        out.extend(page)
        if not page or len(out) >= int(data.get("total", 0)):
            return out


def swept_streams() -> list[str]:
    """The streams others may make consumers on: every one but the work queues."""
    queues = (topology.TURNS_STREAM, topology.STEPS_STREAM)
    return [s for s in topology.stream_names() if s not in queues]


async def sweep(
    js: JetStreamContext,
    streams: Sequence[str] | None = None,
    at: int = SWEEP_AT,
    to: int = SWEEP_TO,
    timeout: float = 5.0,
) -> dict[str, int]:
    """One round: on each stream holding ``at`` consumers or more, delete others' down to
    ``to``. Returns what was deleted, per stream."""
    nc: Nats = js._nc  # the context's connection: nats-py gives it no public name
    out: dict[str, int] = {}
    for stream in streams if streams is not None else swept_streams():
        try:
            info = await js.stream_info(stream)
        except NotFoundError:
            continue
        if info.state.consumer_count < at:
            continue
        infos = await _listed(nc, stream, timeout)
        names = victims(stream, infos, to)
        deleted = 0
        for name in names:
            try:
                await js.delete_consumer(stream, name)
                deleted += 1
            except NotFoundError:
                pass  # gone already (its threshold, or another worker's sweep)
        out[stream] = deleted
        log.warning(
            "consumers.swept",
            stream=stream,
            consumers=len(infos),
            deleted=deleted,
            hint="consumers that are not jetloop's filled the stream; a flood by a client?",
        )
    return out


async def guard_consumers(
    js: JetStreamContext, stop: asyncio.Event, every: float = SWEEP_EVERY
) -> None:
    """``sweep`` every ``every`` seconds until ``stop`` is set (a worker's task)."""
    while not stop.is_set():
        try:
            await sweep(js)
        except (NatsError, TimeoutError) as exc:  # an outage: next round
            log.debug("consumers.sweep_failed", error=str(exc))
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass
