"""Listing a bucket's keys without leaving a consumer behind.

nats-py lists keys through a KV watcher, an ordered push consumer that the server keeps for
five minutes after its subscription ends (its inactive threshold). A stream holds at most
1,000 consumers (measured on nats-server 2.15: the 1,001st is refused, 10026 "maximum
consumers limit reached"), so about three listings a second — a console refreshing a session
page, a client polling snapshots, the registry read on each send — would leave the bucket's
stream unable to make another consumer for minutes, for every reader of the namespace. Here
each listing's consumer is made with a threshold of two seconds: it is gone two seconds after
the listing ends, so even a reader listing ten times a second keeps about twenty.

It is not deleted at once: a delete is a worker's right only (the ``client`` and ``operator``
roles may not delete consumers, ``jetloop.services.natsauth``), and a request they may not
send is never answered, so each listing would wait out the request's timeout — a client's
snapshot, which lists three times, took fifteen seconds.
"""

from __future__ import annotations

from nats.js.kv import KeyValue

# How long the server keeps a listing's consumer once nobody listens.
INACTIVE_SECONDS = 2.0


async def keys(kv: KeyValue, pattern: str = ">") -> list[str]:
    """The keys of ``kv`` matching ``pattern`` (a subject-style pattern), deletes left out;
    empty when there are none."""
    return [e.key for e in await _listed(kv, pattern, values=False)]


async def entries(kv: KeyValue, pattern: str = ">") -> list[KeyValue.Entry]:
    """The current entries (key and value) of ``kv`` matching ``pattern``, deletes left out:
    one listing, not a read per key."""
    return await _listed(kv, pattern, values=True)


async def _listed(kv: KeyValue, pattern: str, values: bool) -> list[KeyValue.Entry]:
    watcher = await kv.watch(
        pattern, ignore_deletes=True, meta_only=not values, inactive_threshold=INACTIVE_SECONDS
    )
    out: list[KeyValue.Entry] = []
    try:
        async for entry in watcher:
            if entry is None:
                break
            out.append(entry)
    finally:
        await watcher.stop()  # type: ignore[no-untyped-call]
    return out
