"""Hand a dead worker's steps on at once, instead of when their leases lapse.

The server sees a worker's connection close the moment its process dies (the kernel closes
the socket) and says so on ``$SYS.ACCOUNT.<account>.DISCONNECT``, which the system account's
``watch`` user may hear (``jetloop.services.natsauth``). Every worker given that user's password
listens; when a connection named ``jetloop-worker-<id>#<incarnation>`` closes — and it was a
connection of this worker's own account and own NATS user (below) —:

1. it asks ``jl.alive.<incarnation>``: an answer means the process lives (it reconnected
   after a network blip, or another server of the cluster has it) — nothing to do. After the
   client's own close ("Client Closed": what a killed process's socket gives) "no
   responders" settles it at once; after another close the process may be connecting again,
   and silence is asked again for a patience that depends on the reason
   (``jetloop.consumers.liveness.patience_after``): 0.75 s after a read or a write error
   (also what a killed process's socket gives: the kernel resets it when data was unread, and
   the server meets the reset reading or writing), 3 s after the server gave up on a slow
   process (a slow consumer, a stale connection);
2. it reads the messages that process held (``jetloop.streams.holds``) and, for each one
   still in its stream (a work queue deletes what was acked), publishes a copy on the same
   subject with the header ``Jl-Holder-Lost: <incarnation>`` and the message id
   ``rescue.<stream>.<sequence>`` — so the copies of several rescuers land once;
3. the delivery of the copy finds the dead attempt's claim, asks ``jl.alive`` itself, and
   takes over at once (``jetloop.consumers.liveness``); the original message comes back when its
   lease lapses and finds the step done (state decides, as for any redelivery).

Nothing here decides an outcome: a copy is one more delivery of a step, and every rule of
the fence holds for it. A worker that is stopped by SIGSTOP keeps its connection (the
server's pings notice only after minutes), so its lease catches it, as before.

Whose closes count. A connection's name is whatever its client said, so anyone who may
connect could name one like a worker's: another namespace's client, opening and closing such
connections, would otherwise set every worker of every namespace rescuing (a round trip and a
bucket read each) and slow them all. A worker acts only on the advisory's ``client.acc`` and
``client.user`` when they are its own: it asks the server who its connection is
(``$SYS.REQ.USER.INFO``), hears only its account's subject
(``$SYS.ACCOUNT.<account>.DISCONNECT``), and, when it connected with a user and a password,
only closes of that user (nats-server's user names are unique across accounts; `jetloop up`
gives a namespace's workers ``<namespace>.worker``, which none of its clients is). A worker
whose server does not answer that question hears every account and filters by its user alone;
one connected without a user (every connection then has a made-up name) by its account alone,
or, when even that is unknown, acts on every close as before. The holds it would read are its
own account's anyway: another account's worker held nothing here.

At start a worker also sweeps: any ``held.<incarnation>`` list in ``jl_workers`` whose
process does not answer is handed on the same way (a worker restarted by ``jetloop up``
rescues what its predecessor held, even without the system account). A list sent to the
server instance this worker is linked to is judged at once (``liveness.silent``: that server
no longer knows the process's subscription; ``jetloop.services.probe`` says why that is
evidence); any other only once its own link has been up for
``jetloop.consumers.liveness.RECONNECT_GRACE``: a worker started just after a server restart
would otherwise hear "no responders" from every live worker still connecting again, and hand
on their steps (their lists name the server's previous instance). Such a process is then asked
again for ``SWEEP_PATIENCE`` more, the lists side by side: a live one stalled across the restart
(a busy machine) may be the last to connect again, and handing on its step settles its call in
doubt as ``outcome_unknown`` where waiting would have seen it finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.parse
from collections.abc import Callable, Coroutine
from typing import Any

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from jetloop.consumers.liveness import gone, patience_after, settled_link, silent
from jetloop.consumers.session import UnscopedRequestId, request_id_of
from jetloop.services.natsauth import DISCONNECT_ADVISORIES
from jetloop.streams import kvkeys
from jetloop.streams.bus import H_HOLDER_LOST
from jetloop.streams.connection import connect, link_of
from jetloop.streams.holds import held_link, read_holds, retire
from jetloop.streams.topology import TURNS_STREAM, WORKERS_BUCKET

# How long the start sweep asks a process whose list names another server instance, once
# its own link has settled, before it counts as gone.
SWEEP_PATIENCE = 3.0

log = structlog.get_logger("jetloop.rescue")

CONNECTION_PREFIX = "jetloop-worker-"
# The watch connection gives up after this long (and is made again later): an outage, or a
# server without the system account's user, costs only the fast path.
WATCH_CONNECT_SECONDS = 10.0


def connection_name(worker_id: str, incarnation: str) -> str:
    """What a worker calls its connection: the server's advisories name it so."""
    return f"{CONNECTION_PREFIX}{worker_id}#{incarnation}"


# Asks the server who a connection is: its user and its account (nats-server 2.10 and later).
USER_INFO = "$SYS.REQ.USER.INFO"
USER_INFO_SECONDS = 2.0


def incarnation_of(name: str) -> str | None:
    if not name.startswith(CONNECTION_PREFIX) or "#" not in name:
        return None
    return name.rpartition("#")[2] or None


def password_user(urls: list[str]) -> str | None:
    """The user a connection to ``urls`` authenticates as with a password (None without one:
    no credentials, or a token, which nats-py also reads from the user part of a URL)."""
    for u in urls:
        parts = urllib.parse.urlsplit(u)
        if parts.username and parts.password is not None:
            return urllib.parse.unquote(parts.username)
    return None


def advisories_of(account: str | None) -> str:
    """The disconnect advisories' subject of ``account`` (every account's when unknown, or
    when its name is no single subject token)."""
    if account is None or not account or any(c in account for c in ".*> \t\r\n"):
        return DISCONNECT_ADVISORIES
    return f"$SYS.ACCOUNT.{account}.DISCONNECT"


class Rescuer:
    """One worker's part: hear connections close, and hand on what their processes held."""

    def __init__(
        self, nc: Client, incarnation: str, stopping: asyncio.Event, user: str | None = None
    ) -> None:
        """``user``: the NATS user ``nc`` authenticated as with a password, if it did
        (``password_user``): only that user's connections are rescued."""
        self.nc = nc
        self.js = nc.jetstream()
        self.incarnation = incarnation
        self.stopping = stopping
        self.user = user
        # This connection's account, as the server said (None: not asked yet, or no answer).
        self.account: str | None = None
        self._asked = False
        # Incarnations being asked or handed on now (by the advisories' path or the probe).
        self.busy: set[str] = set()
        # Whether disconnect advisories are heard now (``watch``): the probe stands by.
        self.watching = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def whoami(self) -> None:
        """Ask the server for this worker's account (and user, when it has one); a server
        that does not answer leaves them as they were (``watch`` then hears every account)."""
        if self._asked:
            return
        try:
            answer = await self.nc.request(USER_INFO, b"", timeout=USER_INFO_SECONDS)
            data = json.loads(answer.data).get("data") or {}
            account = data.get("account")
            user = data.get("user")
        except (NatsError, TimeoutError, ValueError, AttributeError) as exc:
            log.info("rescue.account_unknown", error=str(exc) or type(exc).__name__)
            return
        self._asked = True
        if isinstance(account, str) and account:
            self.account = account
        if self.user is not None and isinstance(user, str) and user:
            self.user = user  # the server's word over the URL's

    async def sweep(self) -> int:
        """Hand on what every process that no longer answers said it held; returns how many
        messages were handed on. A process whose last list was sent to the server instance
        this one is linked to is judged at once (``liveness.silent``: that server no longer
        knows its subscription); any other only once this process's link has been up long
        enough for a live one to have connected again."""
        handed = await self._sweep_same_instance()
        # A worker stopped meanwhile sweeps nothing (its stop must not wait for the link).
        settled = asyncio.ensure_future(settled_link(self.nc))
        stopped = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({settled, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            settled.cancel()
            stopped.cancel()
        if self.stopping.is_set():
            return 0
        others = [i for i in await self.listed() if i != self.incarnation and i not in self.busy]
        counts = await asyncio.gather(*(self._sweep_other(inc) for inc in others))
        return handed + sum(counts)

    async def _sweep_other(self, inc: str) -> int:
        # Asked again for a while: a live process stalled across the restart (a busy
        # machine, a pause) may be the last to connect again; a dead one costs the wait.
        if not await gone(self.nc, inc, SWEEP_PATIENCE):
            return 0
        n = await self.rescue(inc)
        log.info("rescue.swept", incarnation=inc, messages=n)
        return n

    async def listed(self) -> list[str]:
        """The incarnations with a list in ``jl_workers``."""
        kv = await self.js.key_value(WORKERS_BUCKET)
        keys = await kvkeys.keys(kv, "held.>")
        return [k.removeprefix("held.") for k in keys if k.startswith("held.")]

    async def _sweep_same_instance(self) -> int:
        link = link_of(self.nc)
        if link is None:
            return 0
        handed = 0
        for inc in await self.listed():
            if inc == self.incarnation or inc in self.busy:
                continue
            if await held_link(self.js, inc) != link[0] or not await silent(self.nc, inc):
                continue
            n = await self.rescue(inc)
            log.info("rescue.swept", incarnation=inc, messages=n, same_instance=True)
            handed += n
        return handed

    async def watch(self, urls: list[str]) -> None:
        """Listen to the system account's disconnect advisories until stopped."""
        closed: list[bool] = []

        async def on_closed() -> None:
            closed.append(True)

        watch = await connect(
            urls,
            name=f"jetloop-rescue#{self.incarnation}",
            give_up_after=WATCH_CONNECT_SECONDS,
            closed_cb=on_closed,
        )
        try:
            await self.whoami()
            await watch.subscribe(advisories_of(self.account), cb=self._on_advisory)
            self.watching = True
            log.info("rescue.watching", account=self.account, user=self.user)
            while not self.stopping.is_set() and not closed:
                # A second's wait each time, its waiter ended with it (one left pending per
                # second would pile up for as long as the worker runs).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), 1.0)
        finally:
            self.watching = False
            for t in list(self._tasks):
                t.cancel()
            if not watch.is_closed:
                await watch.close()

    async def _on_advisory(self, msg: Msg) -> None:
        try:
            event = json.loads(msg.data)
            client = event.get("client") or {}
            inc = incarnation_of(str(client.get("name") or ""))
            reason = str(event.get("reason") or "")
            account, user = client.get("acc"), client.get("user")
        except (ValueError, AttributeError):
            return
        if inc is None or inc == self.incarnation or inc in self.busy:
            return
        # Another account's or another user's close, whatever its name: not one of ours.
        if self.account is not None and account != self.account:
            return
        if self.user is not None and user != self.user:
            return
        self._spawn(self._after(inc, reason))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        done: Callable[[asyncio.Task[None]], None] = self._tasks.discard
        task.add_done_callback(done)

    async def _after(self, inc: str, reason: str) -> None:
        self.busy.add(inc)
        try:
            if not await gone(self.nc, inc, patience_after(reason)):
                log.info("rescue.still_alive", incarnation=inc, reason=reason)
                return
            handed = await self.rescue(inc)
            log.info("rescue.handed_on", incarnation=inc, reason=reason, messages=handed)
        except Exception as exc:  # an outage: the leases still bring the steps back
            log.warning("rescue.failed", incarnation=inc, error=str(exc))
        finally:
            self.busy.discard(inc)

    async def rescue(self, inc: str) -> int:
        """Publish a copy of every message ``inc`` held that is still in its stream."""
        handed = 0
        for stream, seq in await read_holds(self.js, inc):
            try:
                raw = await self.js.get_msg(stream, seq)
            except NotFoundError:
                continue  # acked: done
            if raw.subject is None:
                continue
            hdrs = {k: v for k, v in (raw.headers or {}).items() if not k.startswith("Nats-")}
            if stream == TURNS_STREAM:
                # The turn's identity is its request id: keep it, whatever the message id.
                sid = raw.subject.rsplit(".", 1)[-1]
                try:
                    rid = request_id_of(raw.headers or {}, sid, raw.time) if raw.time else None
                except UnscopedRequestId:
                    rid = None  # refused when it comes back
                if rid is None:
                    continue  # no id to keep: the lease brings it back
                hdrs["Jl-Request-Id"] = rid
            hdrs["Nats-Msg-Id"] = f"rescue.{stream}.{seq}"
            hdrs[H_HOLDER_LOST] = inc
            try:
                await self.js.publish(raw.subject, raw.data or b"", headers=hdrs)
            except NatsError as exc:
                log.warning("rescue.publish_failed", stream=stream, seq=seq, error=str(exc))
                continue
            handed += 1
        await retire(self.js, inc)
        return handed
