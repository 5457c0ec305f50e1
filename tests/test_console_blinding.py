"""Blinding the console (issue 51): a role below `worker` may make ephemeral consumers, and
nats-server lets such a create name an existing consumer in its body and update it. Neither
`client` nor `operator` can so keep an event from the read model, lock the live views out of
`JL_EVENTS` with a flood of consumers, or deafen the workers' pause watcher."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS
from structlog.testing import capture_logs

from jetloop.schemas import Event, EventType, encode
from jetloop.services import natsauth
from jetloop.services.embedded import EmbeddedServer
from jetloop.services.natsauth import url_as
from jetloop.services.readmodel.model import ReadModel
from jetloop.services.readmodel.projector import DEFAULT_DURABLE, Projector
from jetloop.streams import consumer_guard, topology
from jetloop.streams.connection import inbox_prefix
from jetloop.streams.pauses import Pauses
from jetloop.streams.topology import EVENTS_STREAM, LIMITS_BUCKET
from tests.conftest import WorkerFactory, until


@dataclass
class Authed:
    """A nats-server with `jetloop up`'s users and permissions (the default namespace)."""

    server: EmbeddedServer
    store: Path

    def url(self, role: str = "worker") -> str:
        return url_as(self.server.url, self.store, role)

    async def connect(self, role: str) -> NATS:
        """A plain nats-py connection as ``role``, as an attacker holding its password has it."""
        return await nats.connect(
            self.url(role), inbox_prefix=inbox_prefix(role), max_reconnect_attempts=0
        )


@pytest.fixture
def authed_server(tmp_path: Path) -> Iterator[Authed]:
    store = tmp_path / "jetloop"
    store.mkdir()
    users = natsauth.make_users(store)
    config = tmp_path / "nats-server.conf"
    config.write_text(natsauth.server_config(users))
    srv = EmbeddedServer(
        tmp_path / "store",
        port=0,
        log_file=tmp_path / "nats.log",
        config_file=config,
        auth=("worker", users["worker"]),
    )
    srv.start()
    yield Authed(srv, store)
    srv.kill()


@pytest.fixture
async def authed(authed_server: Authed) -> AsyncIterator[Authed]:
    await authed_server.server.wait_jetstream()
    nc = await authed_server.connect("worker")
    try:
        await topology.apply(nc.jetstream(), topology.TopologyConfig())
    finally:
        await nc.close()
    yield authed_server


async def tamper(nc: NATS, stream: str, name: str, change: dict[str, Any]) -> dict[str, Any]:
    """Update consumer ``name`` of ``stream`` through the legacy ephemeral create (the one a
    role below worker may use), naming it in the body; returns the server's answer."""
    info = json.loads((await nc.request(f"$JS.API.CONSUMER.INFO.{stream}.{name}", b"")).data)
    config = {**info["config"], **change}
    config.pop("durable_name", None)  # refused on this subject; the name is enough
    body = json.dumps({"stream_name": stream, "config": config}).encode()
    answer = await nc.request(f"$JS.API.CONSUMER.CREATE.{stream}", body, timeout=5)
    data: dict[str, Any] = json.loads(answer.data)
    return data


def event(session: str, turn: str, kind: EventType, **data: Any) -> bytes:
    return encode(
        Event(
            key=f"{session}.{turn}.{kind.value}",
            type=kind,
            session_id=session,
            turn_id=turn,
            at=time.time(),
            data=data,
        )
    )


async def publish_turn(nc: NATS, session: str, turn: str) -> int:
    """A turn's first events; returns the last stream sequence."""
    js = nc.jetstream()
    await js.publish(
        topology.event_subject(session, EventType.TURN_ACCEPTED.value),
        event(session, turn, EventType.TURN_ACCEPTED, request_id=turn, queued=False),
    )
    ack = await js.publish(
        topology.event_subject(session, EventType.TURN_STARTED.value),
        event(session, turn, EventType.TURN_STARTED, request_id=turn, agent="a"),
    )
    return ack.seq


TAMPERINGS = {
    # Events delivered without their bodies: before, each was counted unreadable and
    # passed over for good, and a pending approval never reached the console.
    "client-headers-only": ("client", {"headers_only": True}),
    # Fields the projector did not look at: one message in flight at a time, redelivered
    # at most once, its ack due within a millisecond, and a note of the intruder's.
    "operator-pace": (
        "operator",
        {"max_ack_pending": 1, "max_deliver": 1, "ack_wait": 1_000_000, "metadata": {"x": "y"}},
    ),
    # Another filter: the events of one session only (the busy one: no gap shows it).
    "client-filter": ("client", {"filter_subject": "jl.event.s1.>"}),
}


@pytest.mark.parametrize("case", list(TAMPERINGS))
async def test_a_changed_projector_consumer_is_made_again(
    authed: Authed, tmp_path: Path, case: str
) -> None:
    """A `client` or `operator` updates the projector's durable through the legacy ephemeral
    create (headers only; a slower pace and a note; another filter) while events keep coming:
    the projector finds its consumer differs from the one it made, makes it again as it was
    from the read model's position, and every event, an approval request published after the
    tampering included, reaches the read model (a delivery without its body is read again
    from the stream)."""
    role, change = TAMPERINGS[case]
    db = tmp_path / "readmodel.sqlite"
    worker = await authed.connect("worker")
    intruder = await authed.connect(role)
    projector = Projector([authed.url("worker")], db)
    task = asyncio.create_task(projector.run())
    try:
        with capture_logs() as logs:
            await asyncio.wait_for(projector.wait_started(), 30)
            await publish_turn(worker, "s1", "t1")
            made = await consumer_guard.current(worker, EVENTS_STREAM, DEFAULT_DURABLE)
            assert made is not None

            answer = await tamper(intruder, EVENTS_STREAM, DEFAULT_DURABLE, change)
            assert "error" not in answer, answer
            assert all(answer["config"].get(k) == v for k, v in change.items() if k != "metadata")

            # After the tampering: a waiting approval, then the session's turns go on (a
            # busy system: never a quiet second, never a gap) until the consumer is as made.
            ack = await worker.jetstream().publish(
                topology.event_subject("s1", EventType.APPROVAL_REQUESTED.value),
                event(
                    "s1",
                    "t2",
                    EventType.APPROVAL_REQUESTED,
                    approval_id="ap1",
                    call_key="s1.t2.c1",
                    tool="close_ticket",
                ),
            )
            last = ack.seq

            async def undone() -> bool:
                nonlocal last
                last = max(last, await publish_turn(worker, "s1", f"t{last}"))
                now = await consumer_guard.current(worker, EVENTS_STREAM, DEFAULT_DURABLE)
                if now is None:
                    return False
                return {k: v for k, v in now.items() if k != "opt_start_seq"} == {
                    k: v for k, v in made.items() if k != "opt_start_seq"
                }

            await until(undone, timeout=30, every=0.3)
            last = max(last, await publish_turn(worker, "s2", "t1"))

            async def projected() -> bool:
                async with await ReadModel.open(db, readonly=True) as model:
                    if await model.position() < last:
                        return False
                    tables = await model.dump(("audit", "approvals"))
                return len(tables["audit"]) == last and len(tables["approvals"]) == 1

            await until(projected, timeout=30)
        async with await ReadModel.open(db, readonly=True) as model:
            _, inbox = await model.inbox()
        assert [(i["kind"], i["session_id"]) for i in inbox] == [("approval", "s1")]
        changed = [e for e in logs if e["event"] == "projector.consumer_changed"]
        assert changed, "the projector never said its consumer was changed"
        assert not [e for e in logs if e["event"] == "readmodel.unreadable"]
    finally:
        await projector.stop()
        await asyncio.wait_for(task, 30)
        await intruder.close()
        await worker.close()


async def flood(nc: NATS, stream: str, count: int, threshold: float = 3600.0) -> int:
    """Make up to ``count`` ephemerals on ``stream`` with a long inactive threshold, as a
    role below worker may; returns how many the server took (it stops at its limit)."""
    config = {"ack_policy": "none", "mem_storage": True, "inactive_threshold": int(threshold * 1e9)}
    body = json.dumps({"stream_name": stream, "config": config}).encode()
    made = 0
    for _ in range(count):
        answer = json.loads((await nc.request(f"$JS.API.CONSUMER.CREATE.{stream}", body, 5)).data)
        if "error" in answer:
            assert answer["error"]["err_code"] == 10026, answer  # maximum consumers reached
            break
        made += 1
    return made


async def live_view(nc: NATS) -> dict[str, Any]:
    """What the gateway's live view (``services.gateway.sse``) asks for on ``JL_EVENTS``."""
    config = {
        "deliver_policy": "all",
        "ack_policy": "none",
        "inactive_threshold": 30_000_000_000,
        "mem_storage": True,
        "num_replicas": 1,
        "filter_subject": "jl.event.>",
    }
    body = json.dumps({"stream_name": EVENTS_STREAM, "config": config}).encode()
    answer: dict[str, Any] = json.loads(
        (await nc.request(f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}", body, 5)).data
    )
    return answer


async def test_a_consumer_flood_cannot_lock_the_live_views(
    nats_ready: EmbeddedServer, workers: WorkerFactory
) -> None:
    """Consumers are made on `JL_EVENTS` (one-hour inactive threshold, on the subject a
    `client` may use) until the server refuses one (its default cap, 1000 per stream): a live
    view cannot be made. A worker, once started, deletes the flood's consumers (idle first)
    down to `SWEEP_TO`, never the projector's durable, and says so: a live view can be made
    again."""
    nc = await nats.connect(nats_ready.url)
    js = nc.jetstream()
    projector = await consumer_guard.make(
        nc,
        EVENTS_STREAM,
        {"name": DEFAULT_DURABLE, "durable_name": DEFAULT_DURABLE, "ack_policy": "all"},
    )
    try:
        before = (await js.stream_info(EVENTS_STREAM)).state.consumer_count
        started = time.monotonic()
        made = await flood(nc, EVENTS_STREAM, consumer_guard.SERVER_LIMIT + 10)
        took = time.monotonic() - started
        assert made == consumer_guard.SERVER_LIMIT - before
        locked = await live_view(nc)
        assert locked.get("error", {}).get("err_code") == 10026, locked

        worker = workers.start()

        async def room() -> bool:
            info = await js.stream_info(EVENTS_STREAM)
            return info.state.consumer_count <= consumer_guard.SWEEP_TO

        await until(room, timeout=90)
        view = await live_view(nc)
        assert "error" not in view, view
        assert await consumer_guard.current(nc, EVENTS_STREAM, DEFAULT_DURABLE) == projector
        assert "consumers.swept" in worker.log_path.read_text()
        print(f"flood: {made} consumers in {took:.2f}s")
    finally:
        await nc.close()


async def test_a_changed_pause_watcher_is_made_again(authed: Authed) -> None:
    """A `client` updates a worker's pause watcher (headers only, then another filter): the
    watcher finds its consumer changed and makes it again at once, and a pause written
    after each tampering is heard."""
    worker = await authed.connect("worker")
    client = await authed.connect("client")
    pauses = await Pauses.open(worker.jetstream())
    # Another worker's: it writes pauses and does not watch.
    other = Pauses(await worker.jetstream().key_value(LIMITS_BUCKET))
    try:
        stream = f"KV_{LIMITS_BUCKET}"

        async def watcher() -> str | None:
            # The watch's consumer, as an intruder finds it: the stream's only one.
            names = [c.name for c in await client.jetstream().consumers_info(stream)]
            return names[0] if len(names) == 1 else None

        for n, change in enumerate(
            ({"headers_only": True}, {"filter_subject": f"$KV.{LIMITS_BUCKET}.nothing"})
        ):
            name = await until(watcher, timeout=30)
            answer = await tamper(client, stream, name, change)
            assert "error" not in answer, answer
            key = f"pause.test.{n}"
            await other.pause(key, 600, {"provider": "test"})

            async def heard(key: str = key) -> bool:
                return pauses.remaining(key) > 0

            # At once: within a few of the watch's checks (the old one took ~10 s).
            await until(heard, timeout=8)
    finally:
        await pauses.close()
        await client.close()
        await worker.close()
