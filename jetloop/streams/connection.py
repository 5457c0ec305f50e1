"""Connecting to NATS the way a durable worker must (docs/design.md, JetStream facts)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from nats.aio.client import Client, Srv
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import (
    BadHeaderError,
    BadSubjectError,
    ConnectionClosedError,
    ConnectionDrainingError,
    MaxPayloadError,
    NoRespondersError,
    OutboundBufferLimitError,
)
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

from jetloop.schemas.errors import NotAuthorized
from jetloop.streams.headers import parse_header_lines, read_header_block
from jetloop.streams.liblog import LibraryLogger
from jetloop.streams.loops import running_loop
from jetloop.streams.protocol import FastParser

log = LibraryLogger("jetloop.nats")

# The inbox prefix of each role below ``worker`` (``jetloop.services.natsauth`` gives each
# the right to subscribe under its own prefix only). A root of its own, not a token under
# ``_INBOX.``: no grant on ``_INBOX.>`` (the workers' and the projector's inboxes, where
# their pull deliveries and answers arrive) can then cover a role's inboxes, or the other
# way round. Every other user (``worker``, anonymous, a deployment's own) keeps nats-py's
# ``_INBOX``.
INBOX_PREFIXES = {"client": "_INBOX_client", "operator": "_INBOX_operator"}
DEFAULT_INBOX_PREFIX = "_INBOX"
CLIENT_INBOX = INBOX_PREFIXES["client"]


def identity_inbox_prefix(who: str) -> str:
    """The inbox prefix of identity ``who`` of a namespace (``jetloop.services.namespaces``):
    the workers' ``_INBOX``, the roles' own (``INBOX_PREFIXES``), and for any other identity
    (``jetloop namespace credential NS WHO``) ``_INBOX_client_<who>``. A root of its own per
    identity, so that no identity's grant covers another's inboxes (where the answers to its
    decisions and its direct gets arrive): a token after ``_INBOX_client.`` would sit under
    the client's grant. An identity's name (``[a-z0-9][a-z0-9_-]*``) makes a valid token."""
    if who == "worker":
        return DEFAULT_INBOX_PREFIX
    return INBOX_PREFIXES.get(who, f"{CLIENT_INBOX}_{who}")


def inbox_prefix(user: str | None) -> str:
    """The prefix of the inboxes a connection as ``user`` makes (its requests' answers, its
    pull deliveries, its watchers' pushes). A user of a namespace, ``<namespace>.<who>``
    (``jetloop.services.namespaces.user_name``), has its identity's
    (``identity_inbox_prefix``); the default namespace's roles, named without a dot, keep
    theirs, and any other user nats-py's ``_INBOX``."""
    if user and "." in user:
        return identity_inbox_prefix(user.partition(".")[2])
    return INBOX_PREFIXES.get(user or "", DEFAULT_INBOX_PREFIX)


# How long nats-py waits before it tries a server again. A server restarted on the same
# machine is back within about 0.1 s (measured in the kill trials): at 0.5 s a worker stood
# still for most of half a second after it. A try against a closed port costs nothing; one
# against a host that does not answer waits out the connect timeout anyway.
RECONNECT_WAIT = 0.1
# During one outage, a failed try is logged as a warning at most this often (the others at
# debug level, counted in the next warning): ten tries a second would flood the log.
OUTAGE_WARN_EVERY = 10.0


async def connect(
    urls: Sequence[str],
    name: str,
    *,
    give_up_after: float | None = None,
    closed_cb: Callable[[], Awaitable[None]] | None = None,
    reconnected_cb: Callable[[], None] | None = None,
) -> Client:
    """Every server URL, unlimited reconnects, short waits, pings well under 120 s.

    ``give_up_after`` (seconds) is for a client a person waits on (the CLI), not a worker:
    the first connect and a reconnect after an outage each give up after about that long
    (the connection then closes and ``closed_cb`` runs), and outages are logged at debug
    level, since that caller reports them itself. nats-py retries a failed first connect for
    ever unless the attempts per server are bounded, hence the bound and the timeout.
    """
    bounded = give_up_after is not None
    # What an outage looks like in the log: a worker warns, a bounded client only notes it.
    note = log.debug if bounded else log.warning

    refusals: list[str] = []
    connected: list[bool] = []
    # This outage's failed tries: when one was last warned of, and how many were not since.
    warned_at: float | None = None
    unwarned = 0

    async def on_error(exc: Exception) -> None:
        nonlocal warned_at, unwarned
        if "authorization violation" in str(exc).lower():
            refusals.append(str(exc))
            if not connected:
                # A first connect the server refused is no outage to ride out: trying again
                # with the same credentials cannot mend it, and a caller that is not bounded
                # would wait for ever, silently. Raised here, nats-py's connect loop ends with
                # it. (Once connected, a refusal on a reconnect is waited out: a server
                # restarting with its users reloaded.)
                raise NotAuthorized()
        if "permissions violation" in str(exc).lower():
            nc.refused(str(exc))
        if not nc.is_reconnecting:
            note("nats.error", error=str(exc))
            return
        now = time.monotonic()
        if warned_at is not None and now - warned_at < OUTAGE_WARN_EVERY:
            unwarned += 1
            log.debug("nats.error", error=str(exc))
            return
        since = {"tries_since": unwarned} if unwarned else {}
        note("nats.error", error=str(exc), **since)
        warned_at, unwarned = now, 0

    closing: list[Client] = []

    async def on_disconnect() -> None:
        # What was waiting for an answer on this link will not get one (the inboxes are
        # subscribed again only on the next link): said now, so it is asked again then.
        nc.link_lost()
        if closing and (closing[0].is_closed or closing[0].is_draining):
            return  # our own close, not an outage
        note("nats.disconnected")

    async def on_reconnect() -> None:
        nonlocal warned_at, unwarned
        warned_at, unwarned = None, 0
        nc.link_opened()
        log.info("nats.reconnected")
        if reconnected_cb is not None:
            reconnected_cb()

    wait, attempts, connect_timeout = RECONNECT_WAIT, -1, 5.0
    if give_up_after is not None:
        wait = min(RECONNECT_WAIT, give_up_after / 4)
        attempts = max(1, math.ceil(give_up_after / wait))
        connect_timeout = min(5.0, give_up_after)
    # Credentials given in a URL are also given as options: nats-py reconnects to servers
    # the cluster announces (without credentials in their URLs), and there it would connect
    # as nobody — for the system account's watch user, to the global account, where no
    # advisory ever arrives (seen after a node's takeover in a kill trial).
    user, password = credentials_in(urls)
    nc = SizedClient()
    nc.user = user
    try:
        await asyncio.wait_for(
            nc.connect(
                servers=list(urls),
                name=name,
                user=user,
                password=password,
                # Every inbox the connection makes (nc.new_inbox, and nats-py's request
                # subscription, which starts from the same prefix) is under its role's.
                inbox_prefix=inbox_prefix(user),
                max_reconnect_attempts=attempts,
                # nats-py annotates these as int; they are seconds, used as floats
                reconnect_time_wait=wait,  # type: ignore[arg-type]
                ping_interval=5,
                max_outstanding_pings=3,
                connect_timeout=connect_timeout,  # type: ignore[arg-type]
                allow_reconnect=True,
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                closed_cb=closed_cb,
            ),
            give_up_after,
        )
    except BaseException as exc:
        # Stop its reconnect attempts, and close the socket a failed handshake leaves open
        # (else the garbage collector closes it, after the loop is gone): also when this
        # task was cancelled while connecting.
        with contextlib.suppress(Exception):
            await nc.close()
        if refusals and isinstance(exc, Exception):
            raise NotAuthorized() from None
        raise
    connected.append(True)
    closing.append(nc)
    nc.link_opened()
    return nc


def credentials_in(urls: Sequence[str]) -> tuple[str | None, str | None]:
    """The user and password of the first URL that has them (None, None without)."""
    for u in urls:
        parts = urllib.parse.urlsplit(u.strip())
        if parts.username:
            return urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or "")
    return None, None


class PayloadTooLarge(MaxPayloadError):
    """A message whose headers plus body pass the server's ``max_payload``: refused here,
    before it is sent, because the server answers one by closing the connection."""

    def __init__(self, subject: str, size: int, limit: int) -> None:
        super().__init__()
        self.subject = subject
        self.size = size
        self.limit = limit

    def __str__(self) -> str:
        return (
            f"message to {self.subject} is {self.size} bytes with its headers, over the "
            f"server's max_payload of {self.limit} bytes"
        )


class ConnectionLost(ConnectionError):
    """The NATS connection of a long-lived service closed while it was not stopping: nats-py
    will not reconnect a closed connection, so the service ends and is started again."""

    def __init__(self, service: str) -> None:
        super().__init__(f"{service}: the NATS connection closed; exiting to be restarted")
        self.service = service


_HDR_LINE = len(b"NATS/1.0\r\n")


def message_size(payload: bytes, headers: dict[str, str] | None) -> int:
    """What the server counts against ``max_payload``: the header block nats-py writes
    (``NATS/1.0``, one ``key: value`` line each, a blank line) plus the body."""
    if headers is None:
        return len(payload)
    block = _HDR_LINE + 2
    for k, v in headers.items():
        key = k.strip()
        if key:
            block += len(key.encode()) + 2 + len(v.strip().encode()) + 2
    return block + len(payload)


# What an inline subscription is handed for each message: its subject and reply subject (as
# read), its body, and its headers (None without; a status line reads as ``Status``).
Inline = Callable[[bytes, bytes, bytes, "dict[str, str] | None"], None]


class SizedClient(Client):
    """A nats-py client that checks headers plus body against ``max_payload``, reads the
    protocol with ``FastParser`` and header blocks with ``parse_header_lines``, and hands
    the messages of inline subscriptions to their handler as they are read.

    nats-py compares only the body; the server counts the headers too and closes the connection on a
    message that passes the limit (docs/design.md, JetStream facts). Every publish goes through
    ``publish`` (requests, JetStream publishes, KV and object-store writes), so this is the one
    place a message too big is refused, as a ``PayloadTooLarge`` on that call.

    nats-py passes every message of a subscription with a callback through a queue to a
    task of its own, and builds a ``Msg`` for it: for the answers a step waits for (its
    writes' acks, its reads) that is a task switch and two objects per message on the
    worker's CPU budget. An inline subscription (``subscribe_inline``) skips both: its
    handler runs in the reading task, at once, and must not block or raise.
    """

    _parse_header_lines = staticmethod(parse_header_lines)

    def __init__(self) -> None:
        super().__init__()
        self._ps = FastParser(self)
        self._inline: dict[int, Inline] = {}
        self._on_link_lost: list[Callable[[], None]] = []
        self._on_refused: list[Callable[[str], None]] = []
        self._kick: asyncio.Future[None] | None = None
        self._kick_due = False
        self._ended = False  # closed for good (see _close)
        self._linked_at: float | None = None  # monotonic time the current link opened
        # The NATS user it connects as (None: anonymous or a credentials file): in a namespace,
        # ``<namespace>.<who>`` (``jetloop.services.namespaces``).
        self.user: str | None = None

    async def _close(self, status: int, do_cbs: bool = True) -> None:
        # CLOSED is the end (close(), drain, given up); nats-py's first connect also calls
        # this between failed attempts, with DISCONNECTED, and its status then reads closed.
        if status == Client.CLOSED:
            self._ended = True
            if self._status in (Client.RECONNECTING, Client.DISCONNECTED):
                # Closed in an outage: what was queued for the lost link will never be sent
                # (no link follows a close). nats-py would write it to the dead socket, which
                # uvloop refuses with a RuntimeError: Ctrl-C on a worker whose server was
                # gone ended in a traceback.
                self._pending = []
                self._pending_data_size = 0
        await super()._close(status, do_cbs)

    async def _connect_to_server(self, s: Srv) -> None:
        # A client that was closed connects no more. nats-py's reconnect loop ends only when
        # its task is cancelled, and on Python 3.11 that cancel is lost when it lands as a
        # refused connection completes (``asyncio.wait_for`` then raises the refusal, which
        # the loop takes for one more failed attempt): the loop went on for ever after
        # ``close()`` — ``asyncio.run`` hung at exit cancelling it, and the closed client
        # would have connected again when the server came back. Its next attempt ends it.
        if self._ended:
            raise asyncio.CancelledError
        # nats-py keeps one transport and opens each attempt's socket in it, dropping the
        # last attempt's writer unclosed when a handshake failed (a node frozen or cut off
        # mid-connect): left to the garbage collector, a ResourceWarning. Closed here first.
        if self._transport is not None:
            self._transport.close()  # type: ignore[no-untyped-call]
        await super()._connect_to_server(s)

    def when_link_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` each time the connection to the server is lost (``connect``'s
        disconnect callback), before it is made again."""
        self._on_link_lost.append(callback)

    def when_refused(self, callback: Callable[[str], None]) -> None:
        """Call ``callback`` with the server's words each time it refuses a publish or a
        subscription of this connection (a permissions violation: nothing else says so)."""
        self._on_refused.append(callback)

    def refused(self, error: str) -> None:
        for callback in self._on_refused:
            try:
                callback(error)
            except Exception as exc:
                log.error("nats.refused_callback_failed", error=repr(exc))

    def link_opened(self) -> None:
        """The link to a server is (again) up: ``connect`` calls this after the first connect
        and after each reconnect."""
        self._linked_at = time.monotonic()

    @property
    def linked_for(self) -> float:
        """Seconds the current link to a server has been up; 0 while there is none."""
        return 0.0 if self._linked_at is None else time.monotonic() - self._linked_at

    def link_lost(self) -> None:
        self._linked_at = None
        for callback in self._on_link_lost:
            try:
                callback()
            except Exception as exc:
                log.error("nats.link_lost_callback_failed", error=repr(exc))

    async def subscribe_inline(self, subject: str, handler: Inline) -> Subscription:
        """A subscription whose messages go to ``handler`` in the task that reads them.

        It is a subscription like any other to the server and to nats-py (sent again after
        a reconnect, ended by ``unsubscribe_inline``); only its messages take the short way.
        """
        sub = await self.subscribe(subject)
        self._inline[sub._id] = handler
        return sub

    async def unsubscribe_inline(self, sub: Subscription) -> None:
        self._inline.pop(sub._id, None)
        await sub.unsubscribe()

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        handler = self._inline.get(sid)
        if handler is None:
            await super()._process_msg(sid, subject, reply, data, headers)
            return
        self.hand_inline(handler, subject, reply, data, headers)

    def hand_inline(
        self, handler: Inline, subject: bytes, reply: bytes, data: bytes, block: bytes | None
    ) -> None:
        """Give one message of an inline subscription to its handler (``FastParser`` calls
        this for each such message it reads)."""
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        try:
            handler(subject, reply, data, read_header_block(block) if block else None)
        except Exception as exc:  # a handler's bug must not end the connection's reader
            log.error("nats.inline_handler_failed", error=repr(exc))

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        reply: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        # The header block is built once, here, and sized and sent as built (nats-py would
        # build it again, checking each name with a regular expression every time).
        block = b"" if headers is None else header_block(headers)
        size = len(block) + len(payload)
        if size > self.max_payload:
            raise PayloadTooLarge(subject, size, self.max_payload)
        # nats-py's checks before a publish, in its order.
        if not self._skip_subject_validation:
            check_subject(subject)
            if reply:
                check_subject(reply)
        elif not subject:
            raise BadSubjectError
        if self.is_closed:
            raise ConnectionClosedError
        if self.is_draining_pubs:
            raise ConnectionDrainingError
        if not self.is_connected and (
            self._max_pending_size <= 0
            or len(payload) + self._pending_data_size > self._max_pending_size
        ):
            raise OutboundBufferLimitError  # no buffering while it reconnects, or it is full
        if headers is None:  # nats-py's PUB command (an ack, a held list)
            command = b"".join((f"PUB {subject} {reply} {size}\r\n".encode(), payload, _CRLF))
        else:
            command = b"".join(
                (f"HPUB {subject} {reply} {len(block)} {size}\r\n".encode(), block, payload, _CRLF)
            )
        self.stats["out_msgs"] += 1
        self.stats["out_bytes"] += len(payload)
        # nats-py's _send_command and _flush_pending, without their coroutines and the
        # future made per kick (a publish is the worker's most frequent call).
        self._pending.append(command)
        self._pending_data_size += len(command)
        if 0 < self._max_pending_size < self._pending_data_size:
            await self._flush_pending(force_flush=True)  # over the limit: wait for the write
            return
        queue = self._flush_queue
        if self._kick_due or queue is None or not queue.empty():
            return  # a write is already due, and takes this command with it
        flusher = self._flusher_task
        if not self.is_connected or flusher is None or flusher.done():
            await self._flush_pending()  # nats-py's way: queued or written inline
            return
        if self._kick is None:
            # The flusher sets a result on what it is woken with unless it has one: a
            # future done from the start serves every kick.
            self._kick = running_loop().create_future()
            self._kick.set_result(None)
        # The flusher is woken on the loop's next pass, not this one: what the steps
        # running now and next publish goes out in the same write (a write is a system
        # call; under load one carried ~9 commands, now more).
        self._kick_due = True
        running_loop().call_soon(self._wake_flusher)

    def _wake_flusher(self) -> None:
        self._kick_due = False
        queue = self._flush_queue
        if queue is not None and queue.empty() and self._kick is not None:
            queue.put_nowait(self._kick)


_CRLF = b"\r\n"
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE_NEWLINES = str.maketrans({"\r": " ", "\n": " "})
_SUBJECT_INVALID = re.compile(r"[ \t\r\n]")
# Header names seen before, as they go on the wire (a worker uses a few dozen).
_NAMES: dict[str, bytes | None] = {}


def _name_bytes(name: str) -> bytes | None:
    """A header name as sent (stripped), None for an empty one (skipped, as nats-py does);
    a name that is not an RFC 7230 token is refused (``BadHeaderError``)."""
    try:
        return _NAMES[name]
    except KeyError:
        pass
    key = name.strip()
    if not key:
        out = None
    elif _HEADER_NAME.fullmatch(key):
        out = key.encode() + b": "
    else:
        raise BadHeaderError(key)
    if len(_NAMES) < 1024:
        _NAMES[name] = out
    return out


def header_block(headers: dict[str, str]) -> bytes:
    """The header block nats-py writes for ``headers``: ``NATS/1.0``, one ``name: value``
    line each (values stripped, CR and LF made spaces), a blank line."""
    parts = [b"NATS/1.0\r\n"]
    for k, v in headers.items():
        name = _name_bytes(k)
        if name is not None:
            value = v.strip()
            if "\r" in value or "\n" in value:
                value = value.translate(_VALUE_NEWLINES)
            parts.append(name + value.encode() + _CRLF)
    parts.append(_CRLF)
    return b"".join(parts)


def check_subject(subject: str) -> None:
    """nats-py's check of a subject on the publish path: not empty, no whitespace."""
    if not subject or _SUBJECT_INVALID.search(subject):
        raise BadSubjectError


async def subscribe_inline(nc: Client, subject: str, handler: Inline) -> Subscription:
    """``SizedClient.subscribe_inline`` where ``nc`` is one, else a plain subscription whose
    callback hands each message to ``handler`` (a client not made by ``connect``)."""
    if isinstance(nc, SizedClient):
        return await nc.subscribe_inline(subject, handler)

    async def relay(msg: Msg) -> None:
        handler(msg.subject.encode(), msg.reply.encode(), msg.data, msg.headers)

    return await nc.subscribe(subject, cb=relay)


class AnswerLost(NatsTimeoutError):
    """The connection was lost while a request waited for its answer: the answer will not
    come (a timeout early, so callers treat it as one: asked again once connected)."""

    def __str__(self) -> str:
        return "nats: the connection was lost before the answer came"


def linked_for(nc: Client) -> float:
    """``SizedClient.linked_for`` where ``nc`` is one; another client counts as linked for
    ever (its outages are not seen here)."""
    return nc.linked_for if isinstance(nc, SizedClient) else math.inf


def link_of(nc: Client) -> tuple[str, float] | None:
    """The link ``nc`` is on now: the id of the server instance it is connected to (a
    nats-server makes a new id at every start) and when this link opened (a link made again
    to the same instance is another link); None while it is not connected. Only a
    ``SizedClient`` knows when its link opened; another client's reads as opened at 0."""
    if not nc.is_connected:
        return None
    server_id = (nc._server_info or {}).get("server_id")  # nats-py keeps the server's INFO here
    if not isinstance(server_id, str) or not server_id:
        return None
    opened = nc._linked_at if isinstance(nc, SizedClient) else 0.0
    return (server_id, opened) if opened is not None else None


def when_link_lost(nc: Client, callback: Callable[[], None]) -> None:
    """``SizedClient.when_link_lost`` where ``nc`` is one (else: such waits time out)."""
    if isinstance(nc, SizedClient):
        nc.when_link_lost(callback)


def when_refused(nc: Client, callback: Callable[[str], None]) -> None:
    """``SizedClient.when_refused`` where ``nc`` is one."""
    if isinstance(nc, SizedClient):
        nc.when_refused(callback)


async def unsubscribe_inline(nc: Client, sub: Subscription) -> None:
    if isinstance(nc, SizedClient):
        await nc.unsubscribe_inline(sub)
    else:
        await sub.unsubscribe()


T = TypeVar("T")

# What a server restart or a leader election looks like from a client: nobody answers yet.
TRANSIENT: tuple[type[BaseException], ...] = (
    NoRespondersError,
    NoStreamResponseError,
    ServiceUnavailableError,
    NatsTimeoutError,
    TimeoutError,
)


# JetStream's answer to a publish whose Nats-Msg-Id another publish is storing at this moment
# (the same request sent again by a client that heard nothing, beside its own retry): that one
# lands or fails, and asked again the server answers "duplicate" or stores this one.
MSG_ID_IN_PROCESS = 10158


def transient(exc: BaseException) -> bool:
    """Whether asking again may succeed: no leader yet, or the same message id in process."""
    if isinstance(exc, TRANSIENT):
        return True
    # getattr: some of nats-py's APIError subclasses (KeyNotFoundError) have no err_code.
    return isinstance(exc, APIError) and getattr(exc, "err_code", None) == MSG_ID_IN_PROCESS


RETRY_DELAY_CAP = 0.5


async def retrying(op: Callable[[], Awaitable[T]], seconds: float, what: str = "request") -> T:
    """Run an idempotent operation again while the servers are between leaders (or while
    another publish of the same message id is being stored)."""
    deadline = time.monotonic() + seconds
    delay = 0.1
    while True:
        try:
            return await op()
        except Exception as exc:
            if not transient(exc) or time.monotonic() + delay > deadline:
                raise
            log.info("nats.retry", what=what, error=type(exc).__name__, retry_in=delay)
            await asyncio.sleep(delay)
            # Capped low: once the servers have a leader again, the next try comes soon.
            delay = min(delay * 2, RETRY_DELAY_CAP)


# How long a service's last drain may take before its connection is closed instead.
DRAIN_SECONDS = 5.0


async def finish(nc: Client, timeout: float = DRAIN_SECONDS) -> None:
    """End a service's connection: drain it (what its subscriptions have queued is handled,
    what it published is flushed), or close it when it is not connected. A drain still
    waiting after ``timeout`` — a callback that does not return, a queue nobody reads —
    is given up with the subscriptions that held it named (``nats.drain_slow``), and the
    connection closed: a stop must not wait out nats-py's own 30 s."""
    if nc.is_closed:
        return
    if not nc.is_connected:
        await nc.close()
        return
    draining = asyncio.ensure_future(nc.drain())
    done, _ = await asyncio.wait({draining}, timeout=timeout)
    if draining in done:
        with contextlib.suppress(Exception):
            draining.result()
        return
    held = sorted(
        f"{s.subject} ({s._pending_queue.qsize()} queued)"
        for s in list(nc._subs.values())
        if s._pending_queue is not None
    )
    log.warning("nats.drain_slow", after=timeout, subscriptions=held)
    draining.cancel()  # nats-py then flushes and closes
    await asyncio.wait({draining})
    if not nc.is_closed:
        await nc.close()
