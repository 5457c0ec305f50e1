"""Listing keys leaves no consumer behind for long: a stream holds at most 1,000 consumers,
and nats-py's listings would otherwise keep one each for five minutes
(``jetloop.streams.kvkeys``).

Found by the crash test of a user's agent: its approvals poller read snapshots of sixteen
sessions five times a second, and after a few seconds every snapshot in the namespace failed
("maximum consumers limit reached") until the listings' consumers aged out. A listing must
not delete its consumer either: the client role may not, and a refused request waits out its
timeout (tests/test_nats_auth.py reads snapshots as that role)."""

from __future__ import annotations

from jetloop.services.client import Client
from jetloop.streams import kvkeys, topology
from jetloop.streams.registry import Registry
from tests.conftest import until


async def consumers_on(c: Client, stream: str) -> int:
    return int((await c.js.stream_info(stream)).state.consumer_count)


async def test_snapshots_and_registry_reads_leave_no_consumer(client: Client) -> None:
    """Each read that lists keys (a snapshot lists a session's questions; the registry lists
    workers and agents) leaves its consumer for two seconds at most: thirty rounds of them
    leave none a few seconds later."""
    state = f"KV_{topology.STATE_BUCKET}"
    workers = f"KV_{topology.WORKERS_BUCKET}"
    agents = f"KV_{topology.AGENTS_BUCKET}"
    streams = (state, workers, agents)
    before = {s: await consumers_on(client, s) for s in streams}
    registry = await Registry.open(client.js)
    for _ in range(30):
        await client.snapshot("nobody-here")
        await registry.workers()
        await registry.declared()

    async def back() -> bool:
        return {s: await consumers_on(client, s) for s in streams} == before

    await until(back, timeout=kvkeys.INACTIVE_SECONDS + 10, every=0.25)
