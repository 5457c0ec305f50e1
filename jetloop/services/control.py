"""The control API over NATS request/reply, served by workers (queue group ``jl_control``).

Requests and replies are JSON, so the NATS CLI can drive it:

    nats req jl.control.approve.client '{"session_id":"s1","approval_id":"a…"}'
    nats req jl.control.snapshot.client '{"session_id":"s1"}'

Subjects: ``jl.control.<op>.<who>``, ``<op>`` one of ``approve``, ``reject``, ``answer``,
``cancel``, ``reconcile``, ``approval_policy``, ``snapshot``. ``<who>`` is the identity the
request is made as, and the server lets only that identity's credential publish there
(``jetloop.services.natsauth``): a decision records ``by`` = that identity's NATS user
(``jetloop.services.namespaces.user_name``), whatever the body says. The workers' own role
may also use ``jl.control.<op>``, where the body's ``by`` is kept (it may write state
directly anyway). A privileged decision (``approval_policy``: waiving approval would let a
held tool run unapproved) is the workers' role's alone: made as any ``<who>`` it is refused
(403) here, and the server does not even let the ``client`` role or a named identity
publish it.
A reply is ``{"ok": true, "result": …}`` or ``{"ok": false, "error": {"status", "title",
"detail"}}``; a malformed request gets an error reply and changes nothing, and a request
the servers could not serve just then (an election, a restart, this worker's clock found
off) gets 503, to be repeated. A worker whose clock is off does not subscribe at all.
The Python client (``jetloop.services.client``) asks here when it has no seal key.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import BaseModel, ValidationError

from jetloop.schemas.errors import ControlError
from jetloop.services.namespaces import DEFAULT, user_name
from jetloop.sessions.decisions import Control, dump
from jetloop.sessions.requests import DECISIONS, DecisionRequest, SessionId, refused
from jetloop.sessions.snapshot import snapshot, with_workers
from jetloop.streams.blobs import BlobStore
from jetloop.streams.clock import ClockOff
from jetloop.streams.connection import TRANSIENT
from jetloop.streams.history import HistoryReader
from jetloop.streams.registry import Registry
from jetloop.streams.state import StateStore

log = structlog.get_logger("jetloop.control")

PREFIX = "jl.control"
QUEUE = "jl_control"


def subject(op: str, who: str) -> str:
    """The subject of control request ``op`` made as identity ``who``."""
    return f"{PREFIX}.{op}.{who}"


M = TypeVar("M", bound=BaseModel)


class SnapshotReq(BaseModel):
    session_id: SessionId
    history_offset: int = 0
    history_limit: int = 50


class Problem(BaseModel):
    """Why a control request was not done; ``status`` follows HTTP (404, 409, 422, 503)."""

    status: int
    title: str
    detail: str = ""


class Reply(BaseModel):
    """Every reply on ``jl.control.*``: ``ok`` with the ``result``, or the ``error``."""

    ok: bool
    result: Any = None
    error: Problem | None = None


# The request body of each operation (``jl.control.<op>``): the decisions'
# (``jetloop.sessions.requests``), and the one read.
REQUESTS: dict[str, type[BaseModel]] = {**DECISIONS, "snapshot": SnapshotReq}


class ControlService:
    def __init__(
        self,
        nc: Client,
        state: StateStore,
        control: Control,
        history: HistoryReader,
        blobs: BlobStore,
        namespace: str = DEFAULT,
    ) -> None:
        self.nc = nc
        self.namespace = namespace
        self.state = state
        self.control = control
        self.history = history
        self.blobs = blobs
        self._registry: Registry | None = None
        self._subs: list[Subscription] = []
        self._routes: dict[str, Callable[[bytes, str | None], Awaitable[Any]]] = {
            op: functools.partial(self._decide, model) for op, model in DECISIONS.items()
        }
        self._routes["snapshot"] = self._snapshot

    async def start(self) -> None:
        if not self._subs:
            for pattern in (f"{PREFIX}.*", f"{PREFIX}.*.*"):
                self._subs.append(await self.nc.subscribe(pattern, queue=QUEUE, cb=self._on_msg))

    async def stop(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            await sub.unsubscribe()

    async def _on_msg(self, msg: Msg) -> None:
        # jl.control.<op>.<who>: made as <who>; jl.control.<op>: by the workers' role.
        _, _, op, *who = msg.subject.split(".")
        by = user_name(self.namespace, who[0]) if who else None
        route = self._routes.get(op)
        try:
            if route is None:
                raise ControlError(404, "unknown operation", f"{op}; one of {sorted(self._routes)}")
            reply = Reply(ok=True, result=await route(msg.data, by))
        except ControlError as exc:
            reply = Reply(
                ok=False, error=Problem(status=exc.status, title=exc.title, detail=exc.detail)
            )
        except ClockOff as exc:
            # Found off between two measurements: refuse rather than seal a record every
            # reader rejects; the caller asks again and a worker whose clock is right answers.
            log.warning("control.clock_off", op=op, error=str(exc))
            reply = Reply(ok=False, error=Problem(status=503, title="clock off", detail=str(exc)))
        except TRANSIENT as exc:
            # Mid-election or restarting: the caller may repeat the (idempotent) request.
            log.warning("control.unavailable", op=op, error=type(exc).__name__)
            problem = Problem(
                status=503, title="NATS unavailable", detail=f"{type(exc).__name__}: try again"
            )
            reply = Reply(ok=False, error=problem)
        except Exception as exc:
            log.exception("control.error", op=op)
            reply = Reply(
                ok=False, error=Problem(status=500, title="internal error", detail=str(exc))
            )
        if msg.reply:
            await msg.respond(reply.model_dump_json(exclude_none=True).encode())

    @staticmethod
    def _parse(model: type[M], data: bytes) -> M:
        try:
            return model.model_validate_json(data or b"{}")
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise ControlError(422, "invalid request", f"{where}: {first['msg']}") from None

    async def _decide(self, model: type[DecisionRequest[Any]], data: bytes, by: str | None) -> Any:
        if by is not None and model.privileged:
            # The server lets no such identity publish here (natsauth); refused again in case
            # a server runs with other permissions.
            log.warning("control.refused", op=model.op, who=by)
            raise refused(model.op, by)
        request = self._parse(model, data)
        if by is not None and "by" in type(request).model_fields:
            # Who decided is the credential's, never the message's.
            request = request.model_copy(update={"by": by})
        return dump(await request.run(self.control))

    async def _snapshot(self, data: bytes, by: str | None) -> Any:
        r = self._parse(SnapshotReq, data)
        snap = await snapshot(
            self.state,
            self.history,
            self.blobs,
            r.session_id,
            r.history_offset,
            r.history_limit,
            resolve_results=False,
            namespace=self.namespace,
        )
        if self._registry is None:
            self._registry = await Registry.open(self.nc.jetstream())
        snap = await with_workers(snap, self.nc.jetstream(), self._registry, r.session_id)
        if snap is None:
            raise ControlError(404, "no such session", r.session_id)
        return dump(snap)
