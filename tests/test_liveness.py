"""After an outage, a worker judging another counts only the time it could have heard it.

The rule of ``jetloop.consumers.liveness``, asked directly with a real nats-server: a server
restart cuts every process off, and one that is still connecting again neither beats nor
answers ("no responders", as for a dead one). The holder's silence therefore runs from the
judge's own new link at the latest, and a handed-on copy is not believed before the judge
has been linked for ``RECONNECT_GRACE``. The holder here is an incarnation no process
answers for: what the judge would see of a live worker still connecting again.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import cast

import pytest
from nats.aio.client import Client as Nats

from jetloop.consumers.errors import RetryLater
from jetloop.consumers.liveness import GONE_PATIENCE, RECONNECT_GRACE, holder_lost, patience_after
from jetloop.consumers.runtime import Delivery
from jetloop.schemas import Attempt
from jetloop.services.embedded import EmbeddedServer
from jetloop.streams.bus import H_HOLDER_LOST
from jetloop.streams.connection import connect, linked_for
from tests.conftest import until

HELD = Attempt(no=1, worker="holder", started_at=0.0, incarnation="away1")
KEY = "call.s.t.0.0"


def delivery(nc: Nats, lease: float, headers: dict[str, str] | None = None) -> Delivery:
    """What ``holder_lost`` reads of a delivery: the judge's connection, incarnation and lease,
    and the message's headers."""
    rt = SimpleNamespace(nc=nc, incarnation="judge1", holding=set(), lease_seconds=lease)
    return cast(Delivery, SimpleNamespace(rt=rt, msg=SimpleNamespace(headers=headers)))


async def restarted(server: EmbeddedServer, nc: Nats) -> None:
    """SIGKILL the server, start it again on its store, and wait for ``nc`` to link again."""
    server.kill()
    await asyncio.to_thread(server.start)
    await server.wait_jetstream()

    async def linked_again() -> bool:
        return nc.is_connected and linked_for(nc) < RECONNECT_GRACE

    await until(linked_again, timeout=20)


async def linked_longer_than(nc: Nats, seconds: float) -> None:
    async def long_enough() -> bool:
        return linked_for(nc) > seconds

    await until(long_enough, timeout=seconds + 10)


async def test_silence_counts_from_the_judges_new_link(nats_ready: EmbeddedServer) -> None:
    """A holder whose last write is 60 s old is not taken by a judge that has just linked
    again after a server restart: it is given a whole lease from that link; after it, a
    holder that still does not answer is taken."""
    lease = 1.5
    nc = await connect([nats_ready.url], "judge")
    try:
        await restarted(nats_ready, nc)
        stored_at = time.time() - 60.0
        with pytest.raises(RetryLater) as waited:
            await holder_lost(delivery(nc, lease), KEY, HELD, stored_at)
        assert waited.value.delay <= lease + 0.1
        await linked_longer_than(nc, lease + 0.05)
        await holder_lost(delivery(nc, lease), KEY, HELD, stored_at)  # returns: taken over
    finally:
        await nc.close()


async def test_a_handed_on_copy_waits_for_the_judges_link_to_settle(
    nats_ready: EmbeddedServer,
) -> None:
    """A copy that says its holder was lost, delivered to a judge linked again a moment ago,
    is handed back until the judge has been linked for ``RECONNECT_GRACE``; then a holder
    that still does not answer is taken."""
    lease = 30.0
    nc = await connect([nats_ready.url], "judge")
    try:
        await restarted(nats_ready, nc)
        copy = delivery(nc, lease, {H_HOLDER_LOST: HELD.incarnation})
        with pytest.raises(RetryLater) as waited:
            await holder_lost(copy, KEY, HELD, time.time())
        assert "connecting again" in waited.value.reason
        await linked_longer_than(nc, RECONNECT_GRACE)
        await holder_lost(copy, KEY, HELD, time.time())  # returns: taken over
    finally:
        await nc.close()


def test_a_reset_socket_is_given_the_short_patience_whichever_way_the_server_met_it() -> None:
    # A killed worker's socket is reset by its kernel: the server reports a read error or a
    # write error depending on what it was doing with the socket at that moment (both were
    # seen in the kill trials). Neither is a live process the server gave up on.
    assert patience_after("Read Error") == GONE_PATIENCE
    assert patience_after("Write Error") == GONE_PATIENCE
    assert patience_after("Client Closed") == 0.0
    assert patience_after("Slow Consumer (Write Deadline)") == RECONNECT_GRACE
    assert patience_after("Stale Connection") == RECONNECT_GRACE
    assert GONE_PATIENCE < 1.0 < RECONNECT_GRACE  # the first under the detection target
