"""The projector: follows ``JL_EVENTS`` into the SQLite read model
(``jetloop.services.readmodel.model``).

One durable pull consumer of its own (``jl_projector`` by default, filter ``jl.event.>``,
ack-all). Each fetched batch is applied in one SQLite transaction that also stores the
batch's last stream sequence; only then is the batch acked (commit, then ack: rule 4 of
docs/design.md, with SQLite as the state). A redelivered message at or below the stored
sequence is skipped, so every event is applied exactly once.

SQLite's position, not the consumer, is the truth: at every start the consumer is created
again to deliver from the stored position + 1. Otherwise a batch fetched but never
committed by a killed run would wait out its ack-wait while newer messages went first, and
the skip rule would then pass over it for good.

The consumer is checked too: a reader without the right to pull or ack it may still change
it (nats-server takes a consumer's name in the body of an ephemeral create, and updates the
consumer so named: ``jetloop.services.natsauth``), e.g. to filter out what it should
project, or to have events delivered without their bodies (``headers_only``). The
projector keeps the server's whole answer to its create (every field, the server's defaults
filled in: ``jetloop.streams.consumer_guard``) and compares the consumer with it every
``CHECK_EVERY`` seconds, at once after a gap in the deliveries (every subject of
``JL_EVENTS`` is the projector's, so they follow each other without one) and after a
delivery without its body; one that differs in any field (or is gone) is made again from
SQLite's position, so nothing is missed. A delivery without its body is never applied as
it came, nor passed over: its message is read again from the stream by its sequence.

A batch SQLite refuses (locked past the busy timeout, disk full, a broken file) rolls back
and ``run()`` raises: its owner starts a new projector on a fresh connection, which resumes
from what SQLite holds (``jetloop up``'s supervisor, or ``run_projector`` alone).

``rebuild`` drops the tables and replays the stream from the start; ``burst`` returns
once the model has caught up with the stream (tests, one-off rebuilds).

Lifecycle (docs/design.md, convention 3): ``run()`` until ``stop()``; ``async with``; a batch in
hand is finished (committed or rolled back) before the connection closes.

Run it alone: ``python -m jetloop.services.readmodel.projector --nats nats://127.0.0.1:4222 --db
.jetloop/readmodel.sqlite [--rebuild] [--burst]``.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import structlog
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from jetloop.consumers.faults import Faults
from jetloop.schemas.errors import SettingsError
from jetloop.services import namespaces
from jetloop.services.lifecycle import Service
from jetloop.services.logs import configure
from jetloop.services.readmodel.model import Incoming, ReadModel
from jetloop.services.settings import load_settings
from jetloop.services.supervisor import Component, GaveUp, Part, Supervisor
from jetloop.streams import consumer_guard, topology
from jetloop.streams.connection import ConnectionLost, connect, finish
from jetloop.streams.intake import Intake

log = structlog.get_logger("jetloop.projector")

DEFAULT_DURABLE = "jl_projector"
EVENTS_FILTER = "jl.event.>"  # every subject of JL_EVENTS
CHECK_EVERY = 5.0  # seconds between looks at the consumer's whole config


def _gap(position: int, msgs: list[Msg]) -> bool:
    """Whether the deliveries after ``position`` skip a stream sequence (the filter covers
    the whole stream: only a message deleted from it, or a consumer changed, leaves one)."""
    expected = position + 1
    for m in msgs:
        seq = m.metadata.sequence.stream
        if seq <= position:
            continue  # a redelivery, skipped by the model
        if seq != expected:
            return True
        expected = seq + 1
    return False


DEFAULT_DB = Path(".jetloop/readmodel.sqlite")


class Projector(Service):
    def __init__(
        self,
        nats_urls: Sequence[str],
        db_path: Path,
        *,
        durable: str = DEFAULT_DURABLE,
        rebuild: bool = False,
        burst: bool = False,
        batch: int = 256,
        ack_wait: float = 30.0,
        faults: Faults | None = None,
    ) -> None:
        super().__init__()
        self.nats_urls = list(nats_urls)
        self.db_path = Path(db_path)
        self.durable = durable
        self.rebuild = rebuild
        self.burst = burst
        self.batch = batch
        self.ack_wait = ack_wait
        self.faults = faults or Faults.from_env()
        self.position = 0
        # The consumer's config as the server answered its create (``consumer_guard.make``).
        self._made: dict[str, Any] = {}

    async def run(self) -> None:
        nc = await connect(self.nats_urls, name=f"jetloop-projector-{self.durable}")
        try:
            model = await ReadModel.open(self.db_path)
            try:
                await self._run(nc, model)
            finally:
                await model.close()
        finally:
            await finish(nc)
            log.info("projector.stopped", position=self.position)

    async def _run(self, nc: Nats, model: ReadModel) -> None:
        js = nc.jetstream()
        fresh = await model.prepare(rebuild=self.rebuild)
        self.position = await model.position()
        log.info("projector.started", db=str(self.db_path), position=self.position, fresh=fresh)
        delay = 0.2
        while not self._stopping.is_set():
            # From what SQLite holds: after a failed batch that is less than was fetched.
            self.position = await model.position()
            try:
                sub = await self._subscribe(nc, js, self.position)
            except (TimeoutError, NatsError) as exc:  # no leader yet, or the server is away
                if nc.is_closed:
                    # A closed connection is never reopened: end, and be made again.
                    raise ConnectionLost(f"projector {self.durable}") from exc
                log.warning("projector.subscribe_failed", error=str(exc), retry_in=delay)
                await self._pause(delay)
                delay = min(delay * 2, 5.0)
                continue
            delay = 0.2
            self._started.set()
            try:
                if await self._consume(js, sub, model):
                    return
            except sqlite3.Error as exc:
                # The batch rolled back. A new projector (a new connection) starts again
                # from what SQLite holds: the owner restarts it, with a pause.
                log.error("projector.apply_failed", error=str(exc), position=self.position)
                raise
            finally:
                # What came and was not applied is delivered again (the durable stays, and
                # is made again on the next start).
                await sub.stop()

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            pass

    async def _subscribe(self, nc: Nats, js: JetStreamContext, position: int) -> Intake:
        """The durable consumer, made again to deliver from ``position + 1``."""
        try:
            await js.delete_consumer(topology.EVENTS_STREAM, self.durable)
        except NotFoundError:
            pass
        info = await js.stream_info(topology.EVENTS_STREAM)
        if position and info.state.first_seq > position + 1:
            log.warning(
                "projector.events_aged_out",
                position=position,
                first_seq=info.state.first_seq,
                hint="the stream dropped events before they were projected",
            )
        self._made = await consumer_guard.make(nc, topology.EVENTS_STREAM, self._config(position))
        # Taken through an intake, not nats-py's fetch: a batched fetch on an idle consumer
        # sometimes holds an event until its timeout (jetloop.streams.intake).
        intake = Intake(nc, topology.EVENTS_STREAM, self.durable)
        await intake.start()
        return intake

    def _config(self, position: int) -> dict[str, Any]:
        """The consumer this projector makes (the server's API names and units)."""
        return {
            "name": self.durable,
            "durable_name": self.durable,
            "description": "jetloop read model projector",
            "filter_subject": EVENTS_FILTER,
            "deliver_policy": "by_start_sequence",
            "opt_start_seq": position + 1,
            # Batches are applied in order, so acking the last settles the batch.
            "ack_policy": "all",
            "ack_wait": int(self.ack_wait * 1e9),
            "max_deliver": -1,
            "max_ack_pending": self.batch * 4,
        }

    async def _consume(self, js: JetStreamContext, sub: Intake, model: ReadModel) -> bool:
        """Apply batches until stopped; True when done (stopped, or caught up in burst)."""
        failures = 0
        checked = time.monotonic()
        while not self._stopping.is_set():
            if time.monotonic() - checked >= CHECK_EVERY:
                checked = time.monotonic()
                if not await self._consumer_is_ours(sub.nc):
                    return False  # subscribe again, from SQLite's position
            try:
                msgs = await sub.take(self.batch, timeout=1.0)
            except NatsError as exc:
                failures += 1
                log.warning("projector.fetch_failed", error=str(exc))
                if failures >= 5:
                    return False  # subscribe again
                await self._pause(0.5)
                continue
            failures = 0
            if not msgs:
                if self.burst and await self._caught_up(js):
                    return True
                continue
            if _gap(self.position, msgs) and not await self._consumer_is_ours(sub.nc):
                return False  # what the gap hid is delivered by the consumer made again
            try:
                batch = await self._bodies(js, msgs)
            except (TimeoutError, NatsError) as exc:
                log.warning("projector.reread_failed", error=str(exc))
                return False  # nothing applied: the consumer made again brings them
            await self.faults.point("projector.before_commit")
            done = await model.apply(batch)
            self.position = done.position
            await self.faults.point("projector.before_ack")
            try:
                await msgs[-1].ack()
            except NatsError as exc:
                # Committed already: a redelivery is skipped by its sequence.
                log.warning("projector.ack_failed", error=str(exc))
            log.debug(
                "projector.applied",
                applied=done.applied,
                skipped=done.skipped,
                unreadable=done.unreadable,
                position=done.position,
            )
            if any(not m.data or consumer_guard.stripped(m) for m in msgs):
                # Read again from the stream and applied: the consumer that left the
                # bodies out is made again now.
                checked = time.monotonic() - CHECK_EVERY
            if self.burst and len(msgs) < self.batch and await self._caught_up(js):
                return True
        return True

    async def _bodies(self, js: JetStreamContext, msgs: list[Msg]) -> list[Incoming]:
        """The batch to apply: each message as delivered, or, when it came without its body
        (a consumer changed to ``headers_only``: ``consumer_guard.stripped``) or without any
        body at all (no event is empty), as the stream holds it, read by its sequence."""
        out = []
        for m in msgs:
            seq = m.metadata.sequence.stream
            if m.data and not consumer_guard.stripped(m):
                out.append(Incoming(seq, m.subject, m.data))
                continue
            try:
                stored = await js.get_msg(topology.EVENTS_STREAM, seq)
            except NotFoundError:
                log.warning("projector.reread_gone", seq=seq)
                out.append(Incoming(seq, m.subject, m.data))  # deleted: unreadable, as before
                continue
            log.warning("projector.reread", seq=seq, hint="delivered without its body")
            out.append(Incoming(seq, stored.subject or m.subject, stored.data or b""))
        return out

    async def _consumer_is_ours(self, nc: Nats) -> bool:
        """Whether the durable is still as made, in every field (False when gone or changed;
        True when that cannot be told now: read on)."""
        try:
            now = await consumer_guard.current(nc, topology.EVENTS_STREAM, self.durable)
        except (TimeoutError, NatsError):
            return True
        if now is None:
            log.warning("projector.consumer_gone", durable=self.durable)
            return False
        fields = consumer_guard.changed(self._made, now)
        if not fields:
            return True
        log.warning(
            "projector.consumer_changed",
            durable=self.durable,
            fields=fields,
            now={f: now.get(f) for f in fields},
            hint="made again from the read model's position; someone else changed it",
        )
        return False

    async def _caught_up(self, js: JetStreamContext) -> bool:
        try:
            info = await js.stream_info(topology.EVENTS_STREAM)
        except (TimeoutError, NatsError):
            return False
        return self.position >= info.state.last_seq


async def run_projector(
    nats_urls: Sequence[str],
    db_path: Path,
    *,
    durable: str = DEFAULT_DURABLE,
    rebuild: bool = False,
    burst: bool = False,
    batch: int = 256,
) -> None:
    """Run a projector until SIGINT/SIGTERM (or, in burst mode, until caught up).

    Not in burst mode it is supervised: a failed projector is restarted with a pause
    (``jetloop.services.supervisor``), the rebuild done once by the first.
    """
    built = 0

    def make() -> Projector:
        nonlocal built
        built += 1
        return Projector(
            nats_urls,
            db_path,
            durable=durable,
            rebuild=rebuild and built == 1,
            burst=burst,
            batch=batch,
        )

    service: Part = make() if burst else Supervisor([[Component("projector", make)]])
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, service.stop_soon)
    try:
        await service.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


@click.command("projector")
@click.option("--nats", "nats_url", help="NATS server URL(s), comma-separated")
@click.option("--db", "db_path", type=click.Path(path_type=Path), help="the read model's file")
@click.option("--durable", default=DEFAULT_DURABLE, show_default=True, help="consumer name")
@click.option("--rebuild", is_flag=True, help="drop the tables and replay from the start")
@click.option("--burst", is_flag=True, help="stop once caught up with the stream")
@click.option("--batch", default=256, show_default=True, help="messages per transaction")
def projector_command(
    nats_url: str | None,
    db_path: Path | None,
    durable: str,
    rebuild: bool,
    burst: bool,
    batch: int,
) -> None:
    """Project JL_EVENTS into the SQLite read model."""
    try:
        settings = load_settings(**({"nats_url": nats_url} if nats_url else {}))
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from None
    configure(settings.log_format, settings.log_level)
    # The namespace's own database (as `up`'s projectors keep them), unless --db names one.
    default_db = settings.readmodel_db or settings.store_dir / DEFAULT_DB.name
    path = db_path or namespaces.readmodel_path(default_db, settings.namespace)
    try:
        asyncio.run(
            run_projector(
                settings.nats_urls, path, durable=durable, rebuild=rebuild, burst=burst, batch=batch
            )
        )
    except GaveUp as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    projector_command()
