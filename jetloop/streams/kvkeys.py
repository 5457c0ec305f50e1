"""Listing a bucket's keys without leaving a consumer behind.

nats-py lists keys through a KV watcher, an ordered push consumer that the server keeps for
five minutes after its subscription ends (its inactive threshold). A stream holds at most
1,000 consumers (measured on nats-server 2.15: the 1,001st is refused, 10026 "maximum
consumers limit reached"), so about three listings a second — a console refreshing a session
page, a client polling snapshots, the registry read on each send — would leave the bucket's
stream unable to make another consumer for minutes, for every reader of the namespace. Here
each listing deletes its consumer as soon as it is done, and a short threshold removes it
even if this process dies first.
"""

from __future__ import annotations

from nats.errors import Error as NatsError
from nats.js.kv import KeyValue

# How long the server keeps a listing's consumer once nobody listens (a backstop: it is
# deleted at once when the listing ends).
INACTIVE_SECONDS = 5.0


async def keys(kv: KeyValue, pattern: str = ">") -> list[str]:
    """The keys of ``kv`` matching ``pattern`` (a subject-style pattern), deletes left out;
    empty when there are none."""
    watcher = await kv.watch(
        pattern, ignore_deletes=True, meta_only=True, inactive_threshold=INACTIVE_SECONDS
    )
    out: list[str] = []
    try:
        async for entry in watcher:
            if entry is None:
                break
            out.append(entry.key)
    finally:
        await watcher.stop()  # type: ignore[no-untyped-call]
        await _delete_consumer(kv, watcher)
    return out


async def _delete_consumer(kv: KeyValue, watcher: KeyValue.KeyWatcher) -> None:
    # nats-py keeps the consumer's name and the JetStream context on private attributes.
    sub = getattr(watcher, "_sub", None)
    name = getattr(sub, "_consumer", None)
    js = getattr(kv, "_js", None)
    stream = getattr(kv, "_stream", None)
    if not (name and js and stream):
        return  # the threshold removes it
    try:
        await js.delete_consumer(stream, name)
    except (NatsError, TimeoutError):
        pass  # gone already, or no server now: the threshold removes it
