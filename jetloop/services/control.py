"""The control API over NATS request/reply, served by workers (queue group ``jl_control``).

Requests and replies are JSON, so the NATS CLI can drive it:

    nats req jl.control.approve '{"session_id":"s1","approval_id":"a…","by":"alice"}'
    nats req jl.control.snapshot '{"session_id":"s1"}'

Subjects: ``jl.control.{approve,reject,answer,cancel,reconcile,approval_policy,snapshot}``.
A reply is ``{"ok": true, "result": …}`` or ``{"ok": false, "error": {"status", "title",
"detail"}}``; a malformed request gets an error reply and changes nothing, and a request
the servers could not serve just then (an election, a restart, this worker's clock found
off) gets 503, to be repeated. A worker whose clock is off does not subscribe at all.
The Python client (``jetloop.services.client``) asks here when it has no seal key.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import AfterValidator, BaseModel, ValidationError

from jetloop.schemas.ids import validate_name
from jetloop.sessions.decisions import Control, ControlError, dump
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


# A session id as every subject and key holds it: a request naming another is refused (422).
SessionId = Annotated[str, AfterValidator(functools.partial(validate_name, "session id"))]


class DecideReq(BaseModel):
    session_id: SessionId
    approval_id: str
    by: str = "nats"
    reason: str | None = None


class AnswerReq(BaseModel):
    session_id: SessionId
    question_id: str
    answer: str
    by: str = "nats"


class CancelReq(BaseModel):
    session_id: SessionId
    turn_id: str | None = None
    by: str = "nats"


class ReconcileReq(BaseModel):
    call_key: str
    succeeded: bool
    result: Any = None
    error: str | None = None
    by: str = "nats"


class PolicyReq(BaseModel):
    session_id: SessionId
    tool: str
    required: bool | None
    agent: str | None = None


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


# The request body of each operation (``jl.control.<op>``), and what its result is.
REQUESTS: dict[str, type[BaseModel]] = {
    "approve": DecideReq,
    "reject": DecideReq,
    "answer": AnswerReq,
    "cancel": CancelReq,
    "reconcile": ReconcileReq,
    "approval_policy": PolicyReq,
    "snapshot": SnapshotReq,
}


class ControlService:
    def __init__(
        self,
        nc: Client,
        state: StateStore,
        control: Control,
        history: HistoryReader,
        blobs: BlobStore,
    ) -> None:
        self.nc = nc
        self.state = state
        self.control = control
        self.history = history
        self.blobs = blobs
        self._registry: Registry | None = None
        self._sub: Subscription | None = None
        self._routes: dict[str, Callable[[bytes], Awaitable[Any]]] = {
            "approve": lambda b: self._decide(b, True),
            "reject": lambda b: self._decide(b, False),
            "answer": self._answer,
            "cancel": self._cancel,
            "reconcile": self._reconcile,
            "approval_policy": self._policy,
            "snapshot": self._snapshot,
        }

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(f"{PREFIX}.*", queue=QUEUE, cb=self._on_msg)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _on_msg(self, msg: Msg) -> None:
        op = msg.subject.rsplit(".", 1)[-1]
        route = self._routes.get(op)
        try:
            if route is None:
                raise ControlError(404, "unknown operation", f"{op}; one of {sorted(self._routes)}")
            reply = Reply(ok=True, result=await route(msg.data))
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
    def _parse(model: type[Any], data: bytes) -> Any:
        try:
            return model.model_validate_json(data or b"{}")
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise ControlError(422, "invalid request", f"{where}: {first['msg']}") from None

    async def _decide(self, data: bytes, approve: bool) -> Any:
        r = self._parse(DecideReq, data)
        return dump(await self.control.decide(r.session_id, r.approval_id, approve, r.by, r.reason))

    async def _answer(self, data: bytes) -> Any:
        r = self._parse(AnswerReq, data)
        return dump(await self.control.answer(r.session_id, r.question_id, r.answer, r.by))

    async def _cancel(self, data: bytes) -> Any:
        r = self._parse(CancelReq, data)
        return dump(await self.control.cancel(r.session_id, r.turn_id, r.by))

    async def _reconcile(self, data: bytes) -> Any:
        r = self._parse(ReconcileReq, data)
        return dump(await self.control.reconcile(r.call_key, r.succeeded, r.by, r.result, r.error))

    async def _policy(self, data: bytes) -> Any:
        r = self._parse(PolicyReq, data)
        return dump(await self.control.set_approval(r.session_id, r.tool, r.required, r.agent))

    async def _snapshot(self, data: bytes) -> Any:
        r = self._parse(SnapshotReq, data)
        snap = await snapshot(
            self.state,
            self.history,
            self.blobs,
            r.session_id,
            r.history_offset,
            r.history_limit,
            resolve_results=False,
        )
        if self._registry is None:
            self._registry = await Registry.open(self.nc.jetstream())
        snap = await with_workers(snap, self.nc.jetstream(), self._registry, r.session_id)
        if snap is None:
            raise ControlError(404, "no such session", r.session_id)
        return dump(snap)
