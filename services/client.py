"""Driving sessions from Python: send a message, wait for its turn, follow the log.

async with await Client.connect("nats://127.0.0.1:4222") as jl:
    turn = await jl.send("demo", "s1", "look up T-1")
    result = await jl.wait(turn)
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as Nats
from nats.js import api
from nats.js.errors import NotFoundError

from consumers.control import Control
from consumers.snapshot import SessionSnapshot, snapshot
from schemas import (
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
    decode,
    encode,
    turn_id_for,
    validate_name,
)
from streams import topology
from streams.blobs import BlobStore
from streams.bus import Bus
from streams.connection import connect
from streams.history import HistoryReader
from streams.state import StateStore


class TurnFailed(Exception):
    """The turn ended failed or cancelled; ``turn`` has the status and the reason."""

    def __init__(self, turn: TurnRecord) -> None:
        super().__init__(f"turn {turn.turn_id} {turn.status.value}: {turn.error}")
        self.turn = turn


@dataclass(frozen=True)
class TurnHandle:
    agent: str
    session_id: str
    request_id: str
    turn_id: str
    duplicate: bool


@dataclass(frozen=True)
class TurnResult:
    turn_id: str
    status: TurnStatus
    text: str | None
    error: str | None


class Client:
    def __init__(self, nc: Nats, own: bool = False) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self._own = own

    @classmethod
    async def connect(cls, urls: str | Sequence[str]) -> Client:
        if isinstance(urls, str):
            urls = [u.strip() for u in urls.split(",") if u.strip()]
        return cls(await connect(urls, name="jetloop-client"), own=True)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own and not self.nc.is_closed:
            await self.nc.close()

    async def _state(self) -> StateStore:
        return StateStore(await self.js.key_value(topology.STATE_BUCKET))

    async def send(
        self, agent: str, session_id: str, text: str, request_id: str | None = None
    ) -> TurnHandle:
        """Publish a user message; the request id (``Nats-Msg-Id``) makes a resend harmless."""
        validate_name("agent", agent)
        validate_name("session id", session_id)
        rid = request_id or uuid.uuid4().hex
        ack = await self.js.publish(
            topology.turn_subject(agent, session_id),
            encode(TurnRequest(text=text)),
            headers={"Nats-Msg-Id": rid, "Jl-Kind": "turn.request", "Jl-Session": session_id},
        )
        return TurnHandle(agent, session_id, rid, turn_id_for(session_id, rid), bool(ack.duplicate))

    async def turn(self, session_id: str, turn_id: str) -> TurnRecord | None:
        v = await (await self._state()).turn(session_id, turn_id)
        return v.value if v else None

    async def answer_text(self, turn: TurnRecord) -> str | None:
        if turn.answer_ref is not None:
            return (await (await self._blobs()).get(turn.answer_ref)).decode()
        return turn.answer_text

    async def snapshot(
        self, session_id: str, history_offset: int = 0, history_limit: int = 50
    ) -> SessionSnapshot | None:
        """get_agent_snapshot: status, history page, current turn, calls, waits, queue."""
        return await snapshot(
            await self._state(),
            HistoryReader(self.nc),
            await self._blobs(),
            session_id,
            history_offset,
            history_limit,
        )

    async def _blobs(self) -> BlobStore:
        return BlobStore(await self.js.object_store(topology.BLOB_BUCKET), 0)

    async def _control(self) -> Control:
        return Control(await self._state(), Bus(self.js))

    async def approve(
        self, session_id: str, approval_id: str, by: str = "python", reason: str | None = None
    ) -> ApprovalRecord:
        """Approve a held call; the first decision wins and a repeat returns it."""
        return await (await self._control()).decide(session_id, approval_id, True, by, reason)

    async def reject(
        self, session_id: str, approval_id: str, by: str = "python", reason: str | None = None
    ) -> ApprovalRecord:
        """Reject a held call: the model sees it denied, with the reason."""
        return await (await self._control()).decide(session_id, approval_id, False, by, reason)

    async def answer(
        self, session_id: str, question_id: str, answer: str, by: str = "python"
    ) -> QuestionRecord:
        return await (await self._control()).answer(session_id, question_id, answer, by)

    async def cancel(
        self, session_id: str, turn_id: str | None = None, by: str = "python"
    ) -> TurnRecord:
        """Cancel the session's running turn (or the given one)."""
        return await (await self._control()).cancel(session_id, turn_id, by)

    async def reconcile(
        self,
        call_key: str,
        succeeded: bool,
        by: str = "python",
        result: Any = None,
        error: str | None = None,
    ) -> CallRecord:
        """Settle an ``outcome_unknown`` call as succeeded (with a result) or failed."""
        return await (await self._control()).reconcile(call_key, succeeded, by, result, error)

    async def set_approval(
        self, session_id: str, tool: str, required: bool | None, agent: str | None = None
    ) -> SessionRecord:
        """Require (True) or waive (False) approval of a tool in one session; None resets."""
        return await (await self._control()).set_approval(session_id, tool, required, agent)

    async def call(
        self, session_id: str, turn_id: str, model_step: int, index: int
    ) -> CallRecord | None:
        v = await (await self._state()).call(call_key(session_id, turn_id, model_step, index))
        return v.value if v else None

    async def call_result(self, rec: CallRecord) -> Any:
        """A call's recorded result, read from the blob store when it was large."""
        if rec.outcome is None:
            return None
        if rec.outcome.result_ref is not None:
            return json.loads(await (await self._blobs()).get(rec.outcome.result_ref))
        return rec.outcome.result

    async def wait(self, handle: TurnHandle, timeout: float = 60.0) -> TurnResult:
        """Wait until the turn ends; raise ``TurnFailed`` if it failed."""

        async def ended() -> TurnRecord:
            async for ev in self.events(handle.session_id, types=("turn.>",)):
                if ev.turn_id == handle.turn_id and ev.type in (
                    EventType.TURN_COMPLETED,
                    EventType.TURN_FAILED,
                    EventType.TURN_CANCELLED,
                ):
                    break
            t = await self.turn(handle.session_id, handle.turn_id)
            assert t is not None
            return t

        turn = await asyncio.wait_for(ended(), timeout)
        if turn.status in (TurnStatus.FAILED, TurnStatus.CANCELLED):
            raise TurnFailed(turn)
        return TurnResult(turn.turn_id, turn.status, await self.answer_text(turn), turn.error)

    async def events(
        self,
        session_id: str,
        types: Sequence[str] = (">",),
        from_start: bool = True,
    ) -> AsyncIterator[Event]:
        """Follow a session's log (history entries excluded unless asked for)."""
        subjects = [topology.event_subject(session_id, t) for t in types]
        cfg = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.ALL if from_start else api.DeliverPolicy.NEW,
            ack_policy=api.AckPolicy.NONE,
            inactive_threshold=30.0,
            mem_storage=True,
            num_replicas=1,
            filter_subjects=subjects if len(subjects) > 1 else None,
            filter_subject=subjects[0] if len(subjects) == 1 else None,
        )
        sub = await self.js.pull_subscribe(subjects[0], stream=topology.EVENTS_STREAM, config=cfg)
        try:
            while True:
                try:
                    msgs = await sub.fetch(64, timeout=1.0)
                except TimeoutError:
                    continue
                for m in msgs:
                    if ".history." in m.subject:
                        continue
                    yield decode(Event, m.data)
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # the consumer ages out by itself
                pass

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
