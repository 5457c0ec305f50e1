"""The bus against its own users (issue 29, findings 1 and 2): no credential below `worker`
can stop `jetloop up`, sniff or feed others' inboxes, take the projector's events or make a
durable consumer; and every loop that takes messages drops a message that is not a
delivery of its consumer, counts it, logs it once and keeps running."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import api
from structlog.testing import capture_logs

from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer, free_port
from jetloop.services.natsauth import url_as
from jetloop.services.readmodel.projector import DEFAULT_DURABLE
from jetloop.streams.connection import connect, inbox_prefix
from jetloop.streams.intake import FOREIGN, Intake
from jetloop.streams.seal import Sealer, key_bytes
from jetloop.streams.topology import EVENTS_STREAM
from tests.conftest import until
from tests.test_seal_key import Up
from tests.test_up import wait_ready

FLOOD_SECONDS = 15.0


def foreign(stream: str, kind: str) -> float:
    return FOREIGN.labels(stream, kind)._value.get()


async def test_an_intake_drops_what_is_not_its_consumers(nats_ready: EmbeddedServer) -> None:
    """Plain messages published into a pull intake's inbox (with or without headers and a
    reply subject) never reach the taker, which would read their JetStream metadata: each
    is counted, the kind is logged once, and the consumer's real deliveries still come.
    (A reply subject under ``$JS.ACK.`` the server refuses from any client.)"""
    nc = await connect([nats_ready.url], "test-intake")
    js = nc.jetstream()
    await js.add_stream(name="T_INTAKE", subjects=["t.intake.>"])
    await js.add_consumer(
        "T_INTAKE", api.ConsumerConfig(durable_name="d", ack_policy=api.AckPolicy.EXPLICIT)
    )
    intake = Intake(nc, "T_INTAKE", "d")
    await intake.start()
    before = foreign("T_INTAKE", "not_jetstream")
    try:
        with capture_logs() as logs:
            assert await intake.take(4, timeout=0.2) == []  # the requests are open now
            for _ in range(2):
                await nc.publish(f"{intake._inbox}.1.4", b"plain")
                await nc.publish(f"{intake._inbox}.1.4", b"x", headers={"Nats-Msg-Id": "1"})
                await nc.publish(f"{intake._inbox}.1.4", b"x", reply="_INBOX.elsewhere")
            await js.publish("t.intake.a", b"real")
            got: list[Msg] = []

            async def delivered() -> bool:
                got.extend(await intake.take(4, timeout=0.2))
                return bool(got)

            await until(delivered, timeout=10)
        assert [m.data for m in got] == [b"real"]
        assert got[0].metadata.sequence.stream == 1
        assert foreign("T_INTAKE", "not_jetstream") == before + 6
        warned = [e["kind"] for e in logs if e["event"] == "intake.foreign_message"]
        assert warned == ["not_jetstream"], logs
    finally:
        await intake.stop()
        await nc.close()


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    u = Up(tmp_path, gateway_port=free_port())
    u.start()
    try:  # stopped also when it never became ready
        assert u.proc is not None
        wait_ready(u.proc, u.log)
        yield u
    finally:
        u.stop()


class Role:
    """A plain nats-py connection as one role, as an attacker holding its password has it
    (with its role's inbox prefix, or its own JetStream requests would get no answer)."""

    def __init__(self, up: Up, role: str) -> None:
        self.up = up
        self.role = role
        self.errors: list[str] = []
        self.nc = NATS()

    async def connect(self) -> Role:
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc).lower())

        self.nc = await nats.connect(
            url_as(self.up.url, self.up.cwd / ".jetloop", self.role),
            inbox_prefix=inbox_prefix(self.role),
            error_cb=on_error,
            max_reconnect_attempts=0,
        )
        return self

    async def refused(self, subject: str) -> bool:
        await self.nc.flush()

        async def said() -> bool:
            return any("permissions violation" in e and subject.lower() in e for e in self.errors)

        return bool(await until(said, timeout=5))


async def create(nc: NATS, subject: str, config: dict[str, Any]) -> dict[str, Any]:
    """A raw consumer create request and the server's answer ({} when none came)."""
    body = json.dumps({"stream_name": EVENTS_STREAM, "config": config}).encode()
    try:
        answer = await nc.request(subject, body, timeout=1)
    except NatsError:
        return {}
    data: dict[str, Any] = json.loads(answer.data)
    return data


async def pending_approval(gateway: str, session: str) -> bool:
    """Whether the console's inbox (the read model, through the gateway) shows a pending
    approval of ``session``."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{gateway}/v1/inbox?limit=50") as resp:
            if resp.status != 200:
                return False
            items = (await resp.json())["items"]
    return any(i["kind"] == "approval" and i["session_id"] == session for i in items)


async def test_roles_below_worker_cannot_stop_starve_or_blind_up(up: Up) -> None:
    """As `client` and `operator`: other roles' inboxes can be neither heard nor fed, the
    projector's durable can be neither pulled nor acked, no durable can be made, and a change
    to the projector's consumer is undone; for 25 s both inject into every inbox they can
    see (a worker-credentialed insider into the pull inboxes too) while turns are sent: every
    turn completes, `up` keeps running and logs no `component.failed`, and the console's
    inbox shows the pending approval."""
    store = up.cwd / ".jetloop"
    gateway = f"http://127.0.0.1:{up.gateway_port}"
    client, operator = await Role(up, "client").connect(), await Role(up, "operator").connect()
    roles = (client, operator)
    heard: dict[str, int] = {r.role: 0 for r in roles}
    injected = {"worker": 0}
    try:
        for r in roles:
            # Nothing under another prefix, nor everything.
            for subject in ("_INBOX.>", ">", "_INBOX_worker.>"):
                await r.nc.subscribe(subject)
                assert await r.refused(f'subscription to "{subject}"'), (r.role, r.errors)
            # No pull, ack or flow control on the projector's durable.
            pull = f"$JS.API.CONSUMER.MSG.NEXT.{EVENTS_STREAM}.{DEFAULT_DURABLE}"
            await r.nc.publish(pull, b'{"batch": 100}', reply=f"{inbox_prefix(r.role)}.x")
            assert await r.refused(pull), (r.role, r.errors)
            ack = f"$JS.ACK.{EVENTS_STREAM}.{DEFAULT_DURABLE}.1.1.1.0.0"
            await r.nc.publish(ack, b"+ACK")
            assert await r.refused(ack), (r.role, r.errors)
            # No durable, on any subject the server takes one on.
            mine = f"mine_{r.role}"
            for subject in (
                f"$JS.API.CONSUMER.DURABLE.CREATE.{EVENTS_STREAM}.{mine}",
                f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}.{mine}",
            ):
                assert await create(r.nc, subject, {"durable_name": mine, "name": mine}) == {}
                assert await r.refused(subject), (r.role, r.errors)
            legacy = await create(
                r.nc, f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}", {"durable_name": mine}
            )
            assert legacy["error"]["err_code"] == 10020, legacy  # ephemeral only there
            # An ephemeral is theirs to make (jetloop's own readers make them).
            made = await create(r.nc, f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}", {})
            assert "error" not in made and not made["config"].get("durable_name"), made
        names = await client.nc.jetstream().consumers_info(EVENTS_STREAM)
        assert not any(c.name.startswith("mine_") for c in names)

        # What the server still lets through: a consumer named in the body of an ephemeral
        # create updates the consumer of that name. Filtered to nothing, the projector's
        # durable would hide every event from the read model; the projector makes it again.
        info = await operator.nc.jetstream().consumer_info(EVENTS_STREAM, DEFAULT_DURABLE)
        config = {**info.config.as_dict(), "filter_subject": "jl.event.none"}
        config.pop("durable_name")
        changed = await create(operator.nc, f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}", config)
        assert changed.get("config", {}).get("filter_subject") == "jl.event.none", changed

        # The flood: every subject each role may hear, and each message heard is answered
        # with plain messages to its subject and reply; the insider feeds the pull inboxes
        # that heartbeats show.
        async def inject(r: Role, msg: Msg) -> None:
            heard[r.role] += 1
            for target in (msg.subject, msg.reply):
                if target:
                    await r.nc.publish(target, b"not a delivery")

        def injector(r: Role) -> Callable[[Msg], Awaitable[None]]:
            async def cb(msg: Msg) -> None:
                await inject(r, msg)

            return cb

        allowed = {
            client: (
                "_INBOX_client.>",
                "jl.live.>",
                "jl.event.*.turn.*",
                "jl.event.*.history.assistant",
            ),
            operator: ("_INBOX_operator.>",),
        }
        for r, subjects in allowed.items():
            for subject in subjects:
                await r.nc.subscribe(subject, cb=injector(r))
        insider = await nats.connect(url_as(up.url, store, "worker"), max_reconnect_attempts=0)

        async def feed_pull_inbox(msg: Msg) -> None:
            if (msg.headers or {}).get("Status") == "100":  # an idle pull's heartbeat
                injected["worker"] += 1
                await insider.publish(msg.subject, b"not a delivery")

        await insider.subscribe("_INBOX.>", cb=feed_pull_inbox)

        # Turns sent meanwhile by a program with the client credential: its own followers
        # live under the prefix the attacking client hears and feeds.
        key = (store / "seal.key").read_text()
        async with await Client.connect(
            url_as(up.url, store, "client"), sealer=Sealer([key_bytes(key)])
        ) as jl:
            await jl.send("demo", "held", "close T-1")
            deadline = time.monotonic() + FLOOD_SECONDS
            n = 0
            while time.monotonic() < deadline:
                for r in roles:  # broadly into others' inboxes: refused, every time
                    await r.nc.publish(f"_INBOX.{n}", b"x")
                    await r.nc.publish(f"_INBOX.{n}.x.y", b"x")
                h = await jl.send("demo", f"t{n}", "list tickets")
                res = await jl.wait(h, timeout=20)
                assert res.status == "completed", res
                assert up.proc is not None and up.proc.poll() is None, up.log.read_text()
                n += 1
            assert n >= 3
        await insider.close()
        assert heard["client"] > 0 and injected["worker"] > 0, (heard, injected)
        assert await until(lambda: pending_approval(gateway, "held"), timeout=15)
        for r in roles:
            assert any('publish to "_inbox.' in e for e in r.errors), r.errors
    finally:
        for r in roles:
            await r.nc.close()
    log = up.log.read_text()
    assert up.proc is not None and up.proc.poll() is None, log
    assert "component.failed" not in log and "component.gave_up" not in log, log
    assert "intake.foreign_message" in log, log
    assert "projector.consumer_changed" in log, log
