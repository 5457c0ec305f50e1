"""Driving sessions from Python: send a message, wait for its turn, follow the log, read
what happened (a session's snapshot, its past turns, a turn's calls) and decide what waits
for a person (approve, reject, answer, cancel, reconcile).

    async with await Client.connect("nats://127.0.0.1:4222") as jl:
        turn = await jl.send("demo", "s1", "look up T-1")
        result = await jl.wait(turn)

State read from ``jl_state`` is verified with the workers' seal key (``JETLOOP_SEAL_KEY``);
without the key a snapshot is asked of the workers, who verify it (``jl.control.snapshot``),
and another read raises ``SealKeyMissing`` unless the caller chose to read unverified
(``verify=False``, or ``JETLOOP_READ_UNVERIFIED=true`` for ``Client.connect``). Errors are
the ``jetloop.JetloopError`` tree (``jetloop.schemas.errors``); NATS errors pass through once an
outage lasts longer than ``retry_for``. The client logs (never prints) through the
``jetloop.*`` loggers (``jetloop.streams.liblog``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from nats.aio.client import Client as Nats
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import api
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError
from pydantic import BaseModel
from pydantic_core import PydanticSerializationError

from jetloop.agents.agent import Trigger
from jetloop.consumers.side_by_side import side_by_side
from jetloop.schemas import (
    ApprovalRecord,
    CallRecord,
    Event,
    EventType,
    QuestionRecord,
    SessionRecord,
    TurnRecord,
    TurnRequest,
    TurnStatus,
    call_key,
    encode,
    scoped_msg_id,
    turn_id_for,
    validate_name,
)
from jetloop.schemas.errors import (
    ControlError,
    DecodeError,
    RecordNotTrusted,
    SealKeyMissing,
    UnknownSession,
    UnknownTurn,
    WrongNamespace,
)

# Raised by the client, defined with the rest of the public tree: importable from here too.
from jetloop.schemas.errors import TurnFailed as TurnFailed
from jetloop.schemas.errors import UnknownAgent as UnknownAgent
from jetloop.schemas.events import TURN_ENDS
from jetloop.schemas.ids import parse_traceparent
from jetloop.schemas.log import FOLDED_INTO, carrier_roles, events_in
from jetloop.services import namespaces
from jetloop.services.control import PREFIX as CONTROL_PREFIX
from jetloop.services.control import SnapshotReq
from jetloop.services.control import subject as control_subject
from jetloop.services.turnends import RECHECK_SECONDS, TurnEnds
from jetloop.sessions.decisions import Control
from jetloop.sessions.requests import (
    AnswerRequest,
    ApprovalPolicyRequest,
    ApproveRequest,
    CancelRequest,
    DecisionRequest,
    ReconcileRequest,
    RejectRequest,
    refused,
)
from jetloop.sessions.snapshot import MOST_CALLS, SessionSnapshot, snapshot, with_workers
from jetloop.sessions.turns import TurnDetail, TurnPage, list_turns, turn_detail
from jetloop.sessions.usage import UsageLine, distinct
from jetloop.streams import topology
from jetloop.streams.blobs import BlobStore
from jetloop.streams.bus import Bus
from jetloop.streams.clock import CHECK_EVERY, ClockGuard
from jetloop.streams.connection import connect, credentials_in, retrying
from jetloop.streams.history import HistoryReader
from jetloop.streams.intake import Intake
from jetloop.streams.registry import AgentStatus, Registry
from jetloop.streams.seal import Sealer
from jetloop.streams.state import StateStore, Versioned

T = TypeVar("T")
R = TypeVar("R", bound=BaseModel)

# JetStream's answers to a write that cannot be stored: past the namespace's storage limit
# (its account's ``max_file``: ``jetloop.services.namespaces.Limits``), and past what the
# server's disk holds. Either is a ``ControlError`` 507 that says what to do.
ACCOUNT_LIMIT_REACHED = 10002
SERVER_STORAGE_FULL = 10047
STORAGE_FULL_STATUS = 507  # Insufficient Storage (RFC 4918)

# How long one control request over NATS waits for a worker's reply before it is repeated.
CONTROL_TIMEOUT = 5.0
# The title of the ``ControlError`` (503) raised when no worker answers a control request.
NO_WORKER = "no worker serves the control API"


def _mib(n: int | None) -> str:
    return "?" if n is None or n < 0 else f"{n / (1024 * 1024):.1f} MiB"


def control_reply(subject: str, data: bytes) -> Any:
    """The result of a control reply (``jetloop.services.control``), or its error as the
    ``ControlError`` the direct path raises."""
    try:
        reply = json.loads(data)
        if reply.get("ok") is True:
            return reply["result"]
        err = reply["error"]
        status, title, detail = int(err["status"]), str(err["title"]), str(err["detail"])
    except (ValueError, TypeError, KeyError, AttributeError):
        raise ControlError(
            502, "not a control reply", f"{subject} answered {data[:200]!r}"
        ) from None
    raise ControlError(status, title, detail)


async def publish_trigger(js: Any, agent: str, trigger: Trigger) -> None:
    """The schedule message of a cron trigger; publishing it again replaces it."""
    validate_name("agent", agent)
    await js.publish(
        topology.trigger_subject(agent, trigger.name),
        encode(TurnRequest(text=trigger.text)),
        headers={
            "Nats-Schedule": trigger.schedule,
            "Nats-Schedule-Target": topology.turn_subject(agent, trigger.session_id),
            "Jl-Trigger": trigger.name,
        },
    )


@dataclass(frozen=True)
class TurnHandle:
    """A sent request's turn. ``duplicate``: the request id was sent before (its turn
    exists, or its first request is still queued); ``status``: that turn's status, when
    it exists (None for a new request, or a duplicate not accepted yet)."""

    agent: str
    session_id: str
    request_id: str
    turn_id: str
    duplicate: bool
    status: TurnStatus | None = None


@dataclass(frozen=True)
class TurnResult:
    """How a turn ended (``Client.wait``): its id, status, the answer's text (fetched from
    the blob store when it was large) and the error of a failed turn."""

    turn_id: str
    status: TurnStatus
    text: str | None
    error: str | None


# Bounds of one listing of turns or calls (``Client.turns``, ``Client.turn_calls``).
MAX_LIMIT = 1000


class Client:
    """A connection to jetloop: sends messages, follows and reads sessions, decides.

    ``Client.connect(urls)`` opens one (and closes it on ``close()`` / ``async with``);
    ``Client(nc)`` wraps a nats-py connection the caller owns. ``sealer`` is the workers'
    seal key (``Client.connect`` takes it from ``JETLOOP_SEAL_KEY``): with it, state is
    verified when read and decisions are written sealed, as a worker writes them; without
    it decisions are asked of the workers over NATS (``jl.control.*``), which is all the
    ``client`` NATS role may do, a snapshot is asked of them too, and reading other state
    raises ``SealKeyMissing`` unless ``verify=False`` says to read records without checking
    them. ``retry_for`` is how long
    a call rides out a server restart or a leader election before it gives up.
    """

    def __init__(
        self,
        nc: Nats,
        own: bool = False,
        retry_for: float = 30.0,
        sealer: Sealer | None = None,
        *,
        verify: bool = True,
    ) -> None:
        self.nc = nc
        self.sealer = sealer
        self.verify = verify
        self.js = nc.jetstream()
        self._own = own
        self.retry_for = retry_for
        self._state_store: StateStore | None = None
        self._unverified_store: StateStore | None = None
        self._blob_store: BlobStore | None = None
        self._registry: Registry | None = None
        self._ends: TurnEnds | None = None
        # Texts above this go through the blob store (the default blob threshold).
        self.inline_text_limit = 64 * 1024

    @classmethod
    async def connect(
        cls,
        urls: str | Sequence[str],
        sealer: Sealer | None = None,
        *,
        give_up_after: float | None = None,
        on_closed: Callable[[], Awaitable[None]] | None = None,
        verify: bool | None = None,
        namespace: str | None = None,
    ) -> Client:
        """Connect to the NATS servers ``urls`` (a list, or one comma-separated string).

        ``sealer`` defaults to the one the settings give (``JETLOOP_SEAL_KEY``, or the key
        of ``jetloop up`` in the store directory); ``verify`` defaults to True unless
        ``JETLOOP_READ_UNVERIFIED`` is set (see ``Client``). A URL without a user and password
        gets the settings' (``JETLOOP_NATS_USER`` / ``JETLOOP_NATS_PASSWORD``, or the worker
        user of ``jetloop up``'s store directory); a server that refuses them raises
        ``NotAuthorized`` at once, naming those settings.

        By default the client rides out outages as a worker does. ``give_up_after``
        (seconds) is for a caller a person waits on, such as the CLI: the first connect
        raises (``nats.errors.NoServersError`` or ``TimeoutError``) after about that long,
        a lost connection is given up as soon (it closes, and ``on_closed`` runs), requests
        are retried only that long, and outages are not logged as warnings.

        ``namespace`` (default ``JETLOOP_NAMESPACE``, else ``default``) is the namespace to
        act in: a URL without credentials gets its workers' from the store directory; when it
        is named (here or by ``JETLOOP_NAMESPACE``), credentials of another namespace raise
        ``WrongNamespace`` before anything is sent. Credentials alone decide otherwise: a
        credential's namespace is the only one the server shows it.
        """
        if isinstance(urls, str):
            urls = [u.strip() for u in urls.split(",") if u.strip()]
        from jetloop.services.settings import load_settings

        settings = load_settings() if namespace is None else load_settings(namespace=namespace)
        sealer = sealer or settings.sealer()
        verify = not settings.read_unverified if verify is None else verify
        # A URL without a user connects as the settings' (the store's, beside `jetloop up`).
        urls = settings.with_credentials(list(urls))
        user = credentials_in(urls)[0]
        named = namespace is not None or "namespace" in settings.model_fields_set
        if named and user is not None and namespaces.identity(user)[0] != settings.namespace:
            raise WrongNamespace(user, namespaces.identity(user)[0], settings.namespace)
        nc = await connect(
            urls, name="jetloop-client", give_up_after=give_up_after, closed_cb=on_closed
        )
        retry_for = 30.0 if give_up_after is None else give_up_after
        return cls(nc, own=True, sealer=sealer, retry_for=retry_for, verify=verify)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection if this client opened it (idempotent)."""
        if self._own and not self.nc.is_closed:
            await self.nc.close()

    async def _state(self) -> StateStore:
        """The state bucket with this client's sealer (decisions write through it)."""
        # Bound once: binding asks the server for the bucket, which fails mid-election.
        if self._state_store is None:
            self._state_store = await retrying(
                lambda: StateStore.open(self.nc, self.sealer), self.retry_for, "bind"
            )
        return self._state_store

    async def _reader(self, what: str) -> StateStore:
        """The state bucket to read ``what`` from: verified, or unverified by choice."""
        if not self.verify:
            if self._unverified_store is None:
                self._unverified_store = await retrying(
                    lambda: StateStore.open(self.nc, None), self.retry_for, "bind"
                )
            return self._unverified_store
        if self.sealer is None:
            raise SealKeyMissing(what)
        return await self._state()

    async def registry(self) -> Registry:
        """The agents ever served and the live workers (``jl_agents``, ``jl_workers``)."""
        if self._registry is None:
            self._registry = await retrying(
                lambda: Registry.open(self.js), self.retry_for, "bind registry"
            )
        return self._registry

    async def agent_status(self, agent: str) -> AgentStatus:
        """``unknown`` (never served), ``offline`` (no live worker now) or ``live``."""
        reg = await self.registry()
        return await retrying(lambda: reg.status(agent), self.retry_for, "agent status")

    async def send(
        self,
        agent: str,
        session_id: str,
        text: str,
        request_id: str | None = None,
        *,
        traceparent: str | None = None,
        will_wait: bool = True,
    ) -> TurnHandle:
        """Publish a user message; the request id makes a resend harmless.

        ``will_wait``: the caller waits for the turn soon (``wait``), so its end is listened
        for from before the publish and the wait reads the record once; pass False when it
        will not (nothing is then held for a wait that never comes).

        ``traceparent`` (W3C Trace Context, ``00-<trace id>-<span id>-<flags>``) makes the
        turn's trace a child of the caller's span (docs/operating.md, "Traces"); a malformed
        one is a ``ValueError``.

        A repeat is told from state: the turn id is derived from the request id, so a turn
        record that exists means the request was accepted before; it is not published
        again, and the handle says ``duplicate`` with the turn's status. Otherwise the
        request is published with its ``Nats-Msg-Id``, and the PubAck's ``duplicate`` says
        whether an earlier send of it is still queued. The stream's dedupe window is only
        an optimisation (a work queue forgets the id of an accepted request at a restart):
        the session handler creates the turn only if absent, so nothing runs twice.

        Raises ``UnknownAgent`` when no worker has ever served ``agent`` (a request for an
        agent whose workers are only down is accepted: it waits for them).
        """
        validate_name("agent", agent)
        validate_name("session id", session_id)
        if traceparent is not None and parse_traceparent(traceparent) is None:
            raise ValueError(
                f"traceparent {traceparent!r} is not W3C trace context "
                "(00-<32 hex trace id>-<16 hex span id>-<2 hex flags>, ids not all zero)"
            )
        reg = await self.registry()
        if not await retrying(lambda: reg.known(agent), self.retry_for, "agent lookup"):
            raise UnknownAgent(agent)
        rid = request_id or uuid.uuid4().hex
        tid = turn_id_for(session_id, rid)
        state = await self._state()

        async def earlier_turn() -> Versioned[TurnRecord] | None:
            if request_id is None:
                return None
            # Existence and status only, so a client with another seal key can send too.
            return await state.turn(session_id, tid, verify=False)

        async def session_agent() -> str | None:
            try:
                cur = await state.session(session_id, verify=False)
            except DecodeError:
                return None  # a newer writer's record: the worker tells
            return cur.value.agent if cur is not None else None

        # Read side by side: one round trip for both.
        earlier, owner = await retrying(
            lambda: side_by_side(earlier_turn(), session_agent()), self.retry_for, "read"
        )
        if earlier is not None:
            return TurnHandle(agent, session_id, rid, tid, True, earlier.value.status)
        if owner is not None and owner != agent:
            # Refused here, before anything is written: the worker would refuse it too, as a
            # failed turn in the other agent's session.
            raise ControlError(
                409,
                "session of another agent",
                f"session {session_id} belongs to agent {owner!r}, not {agent!r}: "
                "send to a session id of its own",
            )
        body = TurnRequest(text=text)
        data = text.encode()
        if len(data) > self.inline_text_limit:
            # Too large to travel inline: the text goes to jl_blobs, the request names it.
            blobs = await self._blobs()
            ref = await self._stored(
                lambda: retrying(
                    lambda: blobs.put(f"request.{session_id}.{rid}", data), self.retry_for, "blob"
                )
            )
            body = TurnRequest(text="", text_ref=ref)
        headers = {
            # The stream dedupes ids across all subjects: scope the id by session.
            "Nats-Msg-Id": scoped_msg_id(session_id, rid),
            "Jl-Request-Id": rid,
            "Jl-Kind": "turn.request",
            "Jl-Session": session_id,
        }
        if traceparent is not None:
            headers["traceparent"] = traceparent
        # Listened for before it is sent: the wait that follows hears every end of the turn.
        ends = self._turn_ends()
        if will_wait:
            await ends.before_send(session_id, tid)
        try:
            ack = await self._stored(
                lambda: retrying(
                    lambda: self.js.publish(
                        topology.turn_subject(agent, session_id),
                        encode(body),
                        headers=dict(headers),
                    ),
                    self.retry_for,
                    "send",
                )
            )
        except BaseException:
            ends.not_sent(session_id, tid)
            raise
        return TurnHandle(agent, session_id, rid, tid, bool(ack.duplicate))

    async def _stored(self, write: Callable[[], Awaitable[T]]) -> T:
        """``write``, with a refusal for want of storage told as a ``ControlError`` 507 that
        names the namespace's limit and what to do."""
        try:
            return await write()
        except APIError as exc:
            if exc.err_code == SERVER_STORAGE_FULL:
                raise ControlError(
                    STORAGE_FULL_STATUS,
                    "server storage full",
                    "the NATS server's disk holds no more: free space on it, or give it more",
                ) from None
            if exc.err_code != ACCOUNT_LIMIT_REACHED:
                raise
        ns = self.namespace
        used = ""
        with contextlib.suppress(Exception):  # the numbers are a help, not the answer
            info = await self.js.account_info()
            used = f" ({_mib(info.storage)} of {_mib(info.limits.max_storage)} used)"
        raise ControlError(
            STORAGE_FULL_STATUS,
            "namespace storage limit reached",
            f"namespace {ns!r} is at its storage limit (max_file){used}: it takes no more "
            "turns until its workers finish what is queued or an operator raises the limit "
            f"(jetloop namespace limits {ns} --max-file SIZE)",
        )

    async def add_trigger(self, agent: str, trigger: Trigger) -> None:
        """Start (or replace) a cron trigger: a message schedule on jl.cron.<agent>.<name>."""
        await publish_trigger(self.js, agent, trigger)

    async def remove_trigger(self, agent: str, name: str) -> None:
        """Stop a trigger: purging its subject cancels the schedule."""
        validate_name("trigger name", name)
        await self.js.purge_stream(
            topology.TURNS_STREAM, subject=topology.trigger_subject(agent, name)
        )

    async def schedule_turn(
        self, agent: str, session_id: str, text: str, at: datetime, trigger_id: str
    ) -> TurnHandle:
        """A one-off trigger: the message is sent at ``at`` with the caller's id as its
        request id, so scheduling it twice runs it once."""
        validate_name("agent", agent)
        validate_name("session id", session_id)
        validate_name("trigger id", trigger_id)
        when = at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        await self.js.publish(
            topology.trigger_subject(agent, f"once-{trigger_id}"),
            encode(TurnRequest(text=text)),
            headers={
                "Nats-Schedule": f"@at {when}",
                "Nats-Schedule-Target": topology.turn_subject(agent, session_id),
                "Jl-Request-Id": trigger_id,
                "Nats-Msg-Id": f"schedule.{agent}.{trigger_id}",
            },
        )
        return TurnHandle(agent, session_id, trigger_id, turn_id_for(session_id, trigger_id), False)

    async def turn(self, session_id: str, turn_id: str) -> TurnRecord | None:
        """The turn's record (``turn.<sid>.<tid>``), or None when there is none. Raises
        ``RecordNotTrusted`` when its seal does not verify."""
        validate_name("session id", session_id)
        state = await self._reader(f"turn {session_id}/{turn_id}")
        v = await retrying(lambda: state.turn(session_id, turn_id), self.retry_for, "read")
        return v.value if v else None

    async def turns(self, session_id: str, limit: int = 50, offset: int = 0) -> TurnPage:
        """The session's turns, newest first: ``limit`` of them (at most 1000) after skipping
        ``offset``, each with its request id, status, last model step, calls made and error;
        ``total`` counts them all. Records whose seal does not verify are listed and named
        in ``untrusted``. Raises ``UnknownSession`` when the session has no state."""
        validate_name("session id", session_id)
        limit, offset = _bounded(limit, offset)
        state = await self._reader(f"the turns of session {session_id}")
        page = await retrying(
            lambda: list_turns(state, session_id, limit, offset), self.retry_for, "read"
        )
        if page is None:
            raise UnknownSession(session_id)
        return page

    async def turn_calls(
        self, session_id: str, turn_id: str, limit: int = MOST_CALLS
    ) -> TurnDetail:
        """A turn's record and its calls (every model step's, in order: model step, then
        index), each with its tool, effect, state, attempts, idempotency key, result or
        error; at most ``limit`` calls (``calls_more`` counts the rest). Raises
        ``UnknownTurn`` when the session has no such turn."""
        validate_name("session id", session_id)
        validate_name("turn id", turn_id)
        limit, _ = _bounded(limit, 0)
        state, blobs = await self._reader(f"turn {session_id}/{turn_id}"), await self._blobs()
        detail = await retrying(
            lambda: turn_detail(state, blobs, session_id, turn_id, limit, self.namespace),
            self.retry_for,
            "read",
        )
        if detail is None:
            raise UnknownTurn(session_id, turn_id)
        return detail

    async def answer_text(self, turn: TurnRecord) -> str | None:
        """A turn's answer, fetched from the blob store when it was large."""
        if turn.answer_ref is not None:
            return (await (await self._blobs()).get(turn.answer_ref)).decode()
        return turn.answer_text

    async def snapshot(
        self, session_id: str, history_offset: int = 0, history_limit: int = 50
    ) -> SessionSnapshot | None:
        """Everything about a session in one read: its status (``idle``, ``running``,
        ``waiting``, ``waiting_for_worker``), the current (or last) turn and its calls, pending
        approvals and questions, timers, tasks, queued messages, and a page of its history
        (``history_offset``, ``history_limit``). None when the session does not exist.
        Records whose seal does not verify are shown and named in ``untrusted``.

        Without the seal key (and unless ``verify=False``) the workers, who hold it, read and
        verify it (``jl.control.snapshot.<who>``): a credential of the ``client`` role or a
        named identity is enough. Large call results then stay references (``{blob, size}``);
        no worker answering raises ``ControlError`` (503, ``NO_WORKER``)."""
        validate_name("session id", session_id)
        if self.verify and self.sealer is None:
            return await self._workers_snapshot(session_id, history_offset, history_limit)
        state = await self._reader(f"the snapshot of session {session_id}")
        blobs = await self._blobs()

        registry = await self.registry()

        async def read() -> SessionSnapshot | None:
            history = await HistoryReader.for_stream(self.nc)
            snap = await snapshot(
                state,
                history,
                blobs,
                session_id,
                history_offset,
                history_limit,
                namespace=self.namespace,
            )
            return await with_workers(snap, self.js, registry, session_id)

        return await retrying(
            read,
            self.retry_for,
            "snapshot",
        )

    async def _workers_snapshot(
        self, session_id: str, history_offset: int, history_limit: int
    ) -> SessionSnapshot | None:
        """The snapshot as the workers read and verify it (``jetloop.services.control``)."""
        body = SnapshotReq(
            session_id=session_id, history_offset=history_offset, history_limit=history_limit
        )
        try:
            result = await self._ask(
                self._control_subject("snapshot"), body.model_dump_json().encode()
            )
        except ControlError as exc:
            if exc.status == 404:
                return None
            raise
        return SessionSnapshot.model_validate(result)

    async def _blobs(self) -> BlobStore:
        if self._blob_store is None:
            store = await retrying(
                lambda: self.js.object_store(topology.BLOB_BUCKET), self.retry_for, "bind"
            )
            self._blob_store = BlobStore(store, 0)
        return self._blob_store

    async def _control(self) -> Control:
        return Control(await self._state(), Bus(self.js, retry_for=self.retry_for))

    async def decide(self, request: DecisionRequest[R]) -> R:
        """Do one decision (``jetloop.sessions.requests``) and return the record after it. All
        are idempotent: one the servers could not answer is repeated. With the seal key the
        client writes the records itself, as a worker does; without it, it asks the workers
        over NATS (``jl.control.<op>``, served by ``jetloop.services.control``): that needs only
        the ``client`` role, and the workers seal. A credential below the workers' asks them
        even with the key (beside the store, say): the server lets only the workers' role
        write state."""
        if self.sealer is not None and self._writes_state:
            control = await self._control()
            await self._measure_clock(self.sealer)
            return await retrying(lambda: request.run(control), self.retry_for, "control")
        return request.recorded(await self._request(request))

    async def _measure_clock(self, sealer: Sealer) -> None:
        """Deciding with the seal key seals records: measure this process's clock against the
        server's first (again after ``CHECK_EVERY`` seconds), so the sealer refuses
        (``ClockOff``) rather than write a record every reader would reject. A measurement
        that fails keeps the last verdict."""
        if sealer.guard is None:
            sealer.guard = ClockGuard(sealer.tolerance)
        if sealer.guard.due(CHECK_EVERY):
            try:
                await sealer.guard.update(self.nc)
            except Exception:  # an outage: the decision itself meets it, and says so
                pass

    @property
    def _writes_state(self) -> bool:
        """Whether this connection's credential may write state: the workers' role, or a
        connection without a user (a server without authorization)."""
        user = getattr(self.nc, "user", None)
        return user is None or namespaces.identity(user)[1] == namespaces.WORKER

    @property
    def namespace(self) -> str:
        """The namespace this client acts in: its connection's user's (a credential acts in
        one namespace alone), ``default`` for a connection without one."""
        user = getattr(self.nc, "user", None)
        return namespaces.identity(user)[0] if user else namespaces.DEFAULT

    def _control_subject(self, op: str) -> str:
        """Made as the identity this client connected as (``jl.control.<op>.<who>``): the
        workers record it as who decided. The workers' role (or an unnamed connection) uses
        ``jl.control.<op>``, where the request's ``by`` is kept."""
        user = getattr(self.nc, "user", None)
        if user is None:
            return f"{CONTROL_PREFIX}.{op}"
        who = namespaces.identity(user)[1]
        if who == namespaces.WORKER:
            return f"{CONTROL_PREFIX}.{op}"
        return control_subject(op, who)

    async def _request(self, request: DecisionRequest[Any]) -> Any:
        """A control request over NATS; a refusal is the ``ControlError`` the direct path
        raises, and nobody answering is one, too (503)."""
        try:
            data = json.dumps(request.model_dump(mode="json")).encode()
        except (PydanticSerializationError, TypeError, ValueError) as exc:
            raise ControlError(422, "invalid request", f"not JSON: {exc}") from None
        subject = self._control_subject(request.op)
        if request.privileged and subject != f"{CONTROL_PREFIX}.{request.op}":
            # The server would not let this identity publish it: say who may, at once.
            raise refused(request.op, subject.rsplit(".", 1)[1])
        return await self._ask(subject, data)

    async def _ask(self, subject: str, data: bytes) -> Any:
        """Ask the workers' control API (``subject``, a JSON ``data``) until one answers or
        ``retry_for`` ends; its refusal is a ``ControlError``, and nobody answering is one,
        too (503, ``NO_WORKER``)."""
        timeout = min(CONTROL_TIMEOUT, self.retry_for)
        unavailable: list[ControlError] = []

        async def ask() -> Any:
            msg = await self.nc.request(subject, data, timeout=timeout)
            try:
                return control_reply(subject, msg.data)
            except ControlError as exc:
                if exc.status != 503:
                    raise
                # The worker could not reach the servers just then: repeat it, as a timeout.
                unavailable[:] = [exc]
                raise ServiceUnavailableError(description=exc.detail) from None

        try:
            return await retrying(ask, self.retry_for, "control request")
        except ServiceUnavailableError:
            if unavailable:
                raise unavailable[0] from None
            raise
        except (NoRespondersError, NatsTimeoutError, TimeoutError):
            raise ControlError(
                503,
                NO_WORKER,
                f"start one (jetloop up, or jetloop worker with the session pool); "
                f"nobody answered {subject}",
            ) from None

    async def approve(
        self, session_id: str, approval_id: str, by: str = "python", reason: str | None = None
    ) -> ApprovalRecord:
        """Approve a held call; the first decision wins: a repeat returns it, and approving
        a rejected call raises ``ControlError`` (409)."""
        return await self.decide(
            ApproveRequest(session_id=session_id, approval_id=approval_id, by=by, reason=reason)
        )

    async def reject(
        self, session_id: str, approval_id: str, by: str = "python", reason: str | None = None
    ) -> ApprovalRecord:
        """Reject a held call: the model sees it denied, with the reason. Rejecting an
        approved call raises ``ControlError`` (409); a repeat returns the rejection."""
        return await self.decide(
            RejectRequest(session_id=session_id, approval_id=approval_id, by=by, reason=reason)
        )

    async def answer(
        self, session_id: str, question_id: str, answer: str, by: str = "python"
    ) -> QuestionRecord:
        """Answer the model's question; the same answer again returns it, another raises
        ``ControlError`` (409)."""
        return await self.decide(
            AnswerRequest(session_id=session_id, question_id=question_id, answer=answer, by=by)
        )

    async def cancel(
        self, session_id: str, turn_id: str | None = None, by: str = "python"
    ) -> TurnRecord:
        """Cancel the session's running turn (or the given one)."""
        return await self.decide(CancelRequest(session_id=session_id, turn_id=turn_id, by=by))

    async def reconcile(
        self,
        call_key: str,
        succeeded: bool,
        by: str = "python",
        result: Any = None,
        error: str | None = None,
    ) -> CallRecord:
        """Settle an ``outcome_unknown`` call as succeeded (with a result) or failed."""
        return await self.decide(
            ReconcileRequest(
                call_key=call_key, succeeded=succeeded, by=by, result=result, error=error
            )
        )

    async def set_approval(
        self,
        session_id: str,
        tool: str,
        required: bool | None,
        agent: str | None = None,
        by: str = "python",
    ) -> SessionRecord:
        """Require (True) or waive (False) approval of a tool in one session; None resets.
        Recorded with ``by`` and the time (``SessionRecord.approval_changes``, an
        ``approval.policy_changed`` event). Only the workers' role may: with the ``client``
        role or a named identity this raises ``ControlError`` (403)."""
        return await self.decide(
            ApprovalPolicyRequest(
                session_id=session_id, tool=tool, required=required, agent=agent, by=by
            )
        )

    async def call(
        self, session_id: str, turn_id: str, model_step: int, index: int
    ) -> CallRecord | None:
        """One call's record (``call.<sid>.<tid>.<step>.<index>``; a read kept with its step's
        other reads: its entry of ``reads.<sid>.<tid>.<step>``), or None. Raises
        ``RecordNotTrusted`` when its seal does not verify."""
        state = await self._reader(f"call {call_key(session_id, turn_id, model_step, index)}")
        key = call_key(session_id, turn_id, model_step, index)
        v = await retrying(lambda: state.call(key), self.retry_for, "read")
        return v.value if v else None

    async def call_result(self, rec: CallRecord) -> Any:
        """A call's recorded result, read from the blob store when it was large."""
        if rec.outcome is None:
            return None
        if rec.outcome.result_ref is not None:
            return json.loads(await (await self._blobs()).get(rec.outcome.result_ref))
        return rec.outcome.result

    async def wait(self, handle: TurnHandle, timeout: float = 60.0) -> TurnResult:
        """Wait until the turn ends and return how; raise ``TurnFailed`` if it failed or was
        cancelled, ``TimeoutError`` after ``timeout`` seconds.

        Costs no consumer: the turn's end is heard on a core subscription to its session's
        turn ends, which every wait of this client on that session shares, and its record
        read (``jetloop.services.turnends``): once, when the end is heard, for a turn this
        client sent (``send`` listened before it published), else also before listening."""

        async def ended() -> TurnRecord:
            ends = self._turn_ends()
            async with ends.heard(handle.session_id, handle.turn_id) as (heard, whole):
                # Every end of a turn sent just now by this client is heard (``send``
                # listened before it published): its record is read once it is.
                listen_first = whole and not handle.duplicate
                woken = False
                while True:
                    if listen_first:
                        listen_first = False
                        with contextlib.suppress(TimeoutError):
                            woken = await asyncio.wait_for(heard.wait(), RECHECK_SECONDS)
                        heard.clear()
                    try:
                        turn = await self.turn(handle.session_id, handle.turn_id)
                    except RecordNotTrusted:
                        if woken:
                            raise
                        # Not trusted now: the turn fails for it (a worker found it too and
                        # writes the failure, sealed): read again once its end is heard.
                        turn = None
                    if turn is not None and turn.status.terminal:
                        return turn
                    woken = False
                    with contextlib.suppress(TimeoutError):
                        woken = await asyncio.wait_for(heard.wait(), RECHECK_SECONDS)
                    heard.clear()

        turn = await asyncio.wait_for(ended(), timeout)
        if turn.status in (TurnStatus.FAILED, TurnStatus.CANCELLED):
            raise TurnFailed(turn)
        return TurnResult(turn.turn_id, turn.status, await self.answer_text(turn), turn.error)

    def _turn_ends(self) -> TurnEnds:
        if self._ends is None:
            self._ends = TurnEnds(self.nc, self.js)
        return self._ends

    async def events(
        self,
        session_id: str,
        types: Sequence[str] = (">",),
        from_start: bool = True,
        *,
        until_turn_ends: str | None = None,
        follow: bool = True,
    ) -> AsyncIterator[Event]:
        """A session's events (its log, history entries excluded), oldest first.

        ``types`` are event type patterns (``"turn.>"``, ``"call.outcome"``; NATS subject
        wildcards); ``from_start=False`` skips what is stored and yields only new events.
        By default it follows the log for ever; it ends after the event that ends the turn
        ``until_turn_ends`` (``turn.completed``, ``turn.failed`` or ``turn.cancelled``, which
        is yielded when ``types`` covers it), or, with ``follow=False``, once it has caught
        up with the events stored when it started (at once when there are none).

        Survives server restarts and leader elections: it resumes from the last stream
        sequence it delivered on a new consumer, so nothing is skipped or repeated.
        """
        validate_name("session id", session_id)
        wanted = [topology.event_subject(session_id, t) for t in types]
        needed = list(wanted)
        if until_turn_ends is not None:
            needed += [topology.event_subject(session_id, end.value) for end in TURN_ENDS]
        # The folded log carries some types in history entries (jetloop.schemas.log): the
        # entries that may carry a type asked for are read too.
        folded = [
            t for t in FOLDED_INTO if any(_covers(n, _subject(session_id, t)) for n in needed)
        ]
        subjects: list[str] = []
        carriers = [topology.history_subject(session_id, r) for r in carrier_roles(folded)]
        for subject in [*needed, *carriers]:
            if subject not in subjects and not any(_covers(w, subject) for w in wanted):
                subjects.append(subject)
        subjects = [*wanted, *subjects]
        async for ev in self._log(
            session_id, wanted, subjects, from_start, until_turn_ends, follow
        ):
            yield ev

    async def usage(self, session_id: str | None = None) -> list[UsageLine]:
        """The usage ledger (``jetloop.sessions.usage``): one line per model call that got an
        answer, every attempt included, of one session or of every session, each key once.
        Sum them with ``jetloop.sessions.usage.totals``."""
        if session_id is not None:
            validate_name("session id", session_id)
        subject = topology.event_subject(session_id or "*", EventType.MODEL_USAGE.value)
        lines = [
            UsageLine.of(ev)
            async for ev in self._log(session_id, [subject], [subject], True, None, follow=False)
        ]
        return distinct(lines)

    async def _log(
        self,
        session_id: str | None,
        wanted: list[str],
        subjects: list[str],
        from_start: bool,
        until_turn_ends: str | None,
        follow: bool,
    ) -> AsyncIterator[Event]:
        """``events``'s reader: the events on ``subjects`` (those ``wanted`` yielded)."""
        next_seq: int | None = None
        # With follow=False: the last stream sequence to read.
        tail = None if follow else await self._tail()
        while True:
            if next_seq is not None:
                policy, start = api.DeliverPolicy.BY_START_SEQUENCE, next_seq
            else:
                policy = api.DeliverPolicy.ALL if from_start else api.DeliverPolicy.NEW
                start = None
            cfg = api.ConsumerConfig(
                deliver_policy=policy,
                opt_start_seq=start,
                ack_policy=api.AckPolicy.NONE,
                inactive_threshold=30.0,
                mem_storage=True,
                num_replicas=1,
                filter_subjects=subjects if len(subjects) > 1 else None,
                filter_subject=subjects[0] if len(subjects) == 1 else None,
            )
            try:
                intake = await Intake.ephemeral(self.js, topology.EVENTS_STREAM, cfg)
            except (TimeoutError, NatsError):
                await asyncio.sleep(0.2)  # no leader yet (an election, a restart)
                continue
            try:
                if tail is not None and await self._nothing_pending(intake):
                    return
                idle = 0
                while True:
                    try:
                        msgs = await intake.take(64, timeout=1.0)
                    except NatsError:
                        break
                    if not msgs:
                        if tail is not None and await self._nothing_pending(intake):
                            return
                        idle += 1
                        if idle % 5 == 0 and not await self._consumer_alive(intake):
                            break
                        continue
                    idle = 0
                    for m in msgs:
                        seq = m.metadata.sequence.stream
                        next_seq = seq + 1
                        for ev in events_in(m.subject, m.data):
                            told = _subject(session_id or ev.session_id, ev.type)
                            if any(_covers(w, told) for w in wanted):
                                yield ev
                            if ev.turn_id == until_turn_ends and ev.type in TURN_ENDS:
                                return
                        if tail is not None and (seq >= tail or m.metadata.num_pending == 0):
                            return
            finally:
                await intake.stop()

    async def _tail(self) -> int:
        """The stream sequence of the last event stored now: ``events(follow=False)`` stops
        there (or sooner, when nothing it wants is left)."""
        info = await retrying(
            lambda: self.js.stream_info(topology.EVENTS_STREAM), self.retry_for, "events tail"
        )
        return int(info.state.last_seq)

    @staticmethod
    async def _nothing_pending(intake: Intake) -> bool:
        """Whether the consumer has delivered everything stored for it (False when that
        cannot be told now: the caller reads on)."""
        try:
            info = await intake.info()
        except (TimeoutError, NatsError):
            return False
        return int(info.num_pending or 0) == 0 and int(info.num_ack_pending or 0) == 0

    @staticmethod
    async def _consumer_alive(intake: Intake) -> bool:
        try:
            await intake.info()
        except NotFoundError:
            return False
        except (TimeoutError, NatsError):
            return False
        return True

    async def dead_letters(self, limit: int = 100) -> list[tuple[str, str, bytes]]:
        """(subject, reason, body) of stored dead letters, oldest first."""
        out: list[tuple[str, str, bytes]] = []
        seq = 1
        while len(out) < limit:
            try:
                m = await self.js.get_msg(
                    topology.DEAD_STREAM, seq=seq, subject="jl.dead.>", next=True
                )
            except NotFoundError:
                break
            hdrs = m.headers or {}
            out.append(
                (
                    hdrs.get("Jl-Dead-Subject", m.subject or ""),
                    hdrs.get("Jl-Dead-Reason", ""),
                    m.data or b"",
                )
            )
            seq = (m.seq or seq) + 1
        return out


def _subject(session_id: str, etype: EventType) -> str:
    """The subject an event of ``etype`` has in the separate log (the one its type names)."""
    return topology.event_subject(session_id, etype.value)


def _covers(pattern: str, subject: str) -> bool:
    """Whether the NATS subject ``pattern`` (``*`` one token, ``>`` the rest) matches."""
    p, t = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(t) > i
        if i >= len(t) or (token != "*" and token != t[i]):
            return False
    return len(p) == len(t)


def _bounded(limit: int, offset: int) -> tuple[int, int]:
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be 1-{MAX_LIMIT}, not {limit}")
    if offset < 0:
        raise ValueError(f"offset must be 0 or more, not {offset}")
    return limit, offset
