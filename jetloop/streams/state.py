"""Typed access to the ``jl_state`` bucket: every write is a CAS on a revision (rule 2, 9).

``create`` fails when the key exists, ``update`` when the revision moved on. Both raise
``Conflict`` so callers decide in one place whether that is a takeover or a race to retry.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Generic, NamedTuple, TypeVar

import msgpack
from nats.aio.client import Client
from nats.errors import ConnectionClosedError
from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel

from jetloop.schemas import (
    ApprovalRecord,
    CallRecord,
    CompactionRecord,
    QuestionRecord,
    SessionRecord,
    StepReads,
    TurnRecord,
    call_key,
    decode,
    encode,
)
from jetloop.schemas.codec import DecodeError, decode_map
from jetloop.streams import kvkeys
from jetloop.streams.connection import TRANSIENT, retrying
from jetloop.streams.direct import DirectGets, direct_gets
from jetloop.streams.loops import running_loop
from jetloop.streams.replies import connection_of, replies_of
from jetloop.streams.seal import SEAL_FIELD, SealBroken, Sealer, with_seal
from jetloop.streams.topology import STATE_BUCKET

R = TypeVar("R", bound=BaseModel)

# How many verified records a store remembers, decoded (``StateStore._decode``): a turn reads
# the same few records ~5 times each (every call step and join reads its turn, session and
# calls).
VERIFIED_MEMO = 4096


class Conflict(Exception):
    """A CAS lost: the key exists (create) or its revision moved on (update)."""

    def __init__(self, key: str, expected: int | None) -> None:
        super().__init__(f"state key {key} changed (expected revision {expected})")
        self.key = key
        self.expected = expected


@dataclass(frozen=True)
class Versioned(Generic[R]):
    value: R
    revision: int
    # When the server stored this revision (unix seconds, the server's clock): how fresh a
    # claim's last heartbeat is (``consumers.holders``).
    stored_at: float = 0.0


def session_key(session_id: str) -> str:
    return f"session.{session_id}"


def turn_key(session_id: str, turn_id: str) -> str:
    return f"turn.{session_id}.{turn_id}"


def call_state_key(call_key: str) -> str:
    return f"call.{call_key}"


def step_reads_key(session_id: str, turn_id: str, model_step: int) -> str:
    """The record of a model step's reads kept together (``StepReads``)."""
    return f"reads.{session_id}.{turn_id}.{model_step}"


def _reads_key_of(call_key: str) -> str | None:
    """The ``StepReads`` key of the step of call ``call_key`` (None: not a call's key)."""
    parts = call_key.split(".")
    if len(parts) != 4 or not parts[2].isdigit():
        return None
    return step_reads_key(parts[0], parts[1], int(parts[2]))


def _kept_read(reads: Versioned[StepReads] | None, call_key: str) -> Versioned[CallRecord] | None:
    """Call ``call_key``'s outcome as its step's reads record keeps it, if it does: done, and
    versioned as that record (it is never written again)."""
    if reads is None:
        return None
    for rec in reads.value.calls:
        if rec.key == call_key:
            return Versioned(rec, reads.revision, reads.stored_at)
    return None


def approval_key(session_id: str, approval_id: str) -> str:
    return f"approval.{session_id}.{approval_id}"


def question_key(session_id: str, question_id: str) -> str:
    return f"question.{session_id}.{question_id}"


def compaction_key(session_id: str, turn_id: str, model_step: int) -> str:
    return f"compact.{session_id}.{turn_id}.{model_step}"


RETRYABLE: tuple[type[BaseException], ...] = (*TRANSIENT, ConnectionClosedError)

EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
# The server's answers to a CAS whose revision moved on (JSStreamWrongLastSequence…).
WRONG_LAST_SEQUENCE = (10071, 10164)


class Stored(NamedTuple):
    """A key's current value as the server stored it."""

    data: bytes
    revision: int
    stored_at: float  # unix seconds, the server's clock: no publisher can set it
    # The revision the write that stored it expected to replace (its CAS header, kept with the
    # message by the server), None when it was written without one: a seal binds it.
    replaced: int | None = None


def replaced_revision(headers: dict[str, str] | None) -> int | None:
    """The ``Nats-Expected-Last-Subject-Sequence`` a stored message was written with."""
    text = (headers or {}).get(EXPECTED_LAST)
    return int(text) if text is not None and text.isdigit() else None


def _marker(headers: dict[str, str] | None) -> bool:
    """Whether a stored message is a key's delete or purge marker, not a value."""
    return (headers or {}).get("KV-Operation") in ("DEL", "PURGE")


def _stored(data: bytes, seq: int, headers: dict[str, str] | None) -> Stored:
    """A stored message as read, its time and replaced revision from its headers."""
    return Stored(data, seq, stored_time(headers), replaced_revision(headers))


def stored_time(headers: dict[str, str] | None) -> float:
    """The ``Nats-Time-Stamp`` of a direct get (RFC 3339, nanoseconds) as unix seconds."""
    text = (headers or {}).get("Nats-Time-Stamp", "")
    if not text:
        return 0.0
    head, _, frac = text.rstrip("Z").partition(".")
    # The minute is parsed once a minute, not once a read: ``YYYY-MM-DDTHH:MM:SS``.
    minute = _MINUTES.get(head[:16]) if len(head) == 19 and head[16] == ":" else None
    if minute is not None and head[17:].isdigit():
        seconds = minute + int(head[17:])
    else:
        seconds = datetime.fromisoformat(head + "+00:00").timestamp()
        if len(head) == 19 and head[16] == ":" and head[17:].isdigit():
            if len(_MINUTES) > 64:
                _MINUTES.clear()
            _MINUTES[head[:16]] = seconds - int(head[17:])
    return seconds + (float(f"0.{frac}") if frac.isdigit() else 0.0)


_MINUTES: dict[str, float] = {}

_set = object.__setattr__


def _copy_of(record: R) -> R:
    """``record.model_copy()`` (a shallow copy: its own fields, shared nested values) for a
    record with no private attributes or extras, as jetloop's records are, without
    pydantic's generic ``copy.copy`` of each part (a worker copies ~50 records a turn)."""
    if record.__pydantic_extra__ is not None or getattr(record, "__pydantic_private__", None):
        return record.model_copy()
    cls = type(record)
    new = cls.__new__(cls)
    _set(new, "__dict__", record.__dict__.copy())
    _set(new, "__pydantic_extra__", None)
    _set(new, "__pydantic_fields_set__", set(record.__pydantic_fields_set__))
    _set(new, "__pydantic_private__", None)
    return new


@dataclass
class _SharedRead:
    """One batched read being gathered (``StateStore._shared_last``)."""

    answer: asyncio.Future[dict[str, Stored]]
    patterns: dict[str, None] = field(default_factory=dict)  # in order, once each
    most: int = 0

    def settle(self, task: asyncio.Task[dict[str, Stored]]) -> None:
        if self.answer.done():
            return
        if task.cancelled():
            self.answer.cancel()
        elif (exc := task.exception()) is not None:
            self.answer.set_exception(exc)
            self.answer.exception()  # raised to each reader; not "never retrieved" if none is left
        else:
            self.answer.set_result(task.result())


class StateStore:
    """The state bucket, with one typed accessor per record kind.

    Every record is sealed on write and verified on read when a ``Sealer`` is given
    (``jetloop.streams.seal``: the seal binds the key and the time the server stored it);
    ``SealBroken`` says a record is not to be trusted. Given ``direct``
    (a connection, for a bucket with one replica and direct gets allowed), the reads of
    several keys a step needs together are one batched direct get instead of one get each.
    """

    def __init__(
        self,
        js: JetStreamContext,
        kv: KeyValue,
        sealer: Sealer | None = None,
        retry_for: float = 15.0,
        direct: Client | None = None,
        bucket: str = STATE_BUCKET,
        allow_direct: bool = False,
    ) -> None:
        self.js = js
        self._replies = replies_of(connection_of(js))
        self._gets = direct_gets(direct) if direct is not None else None
        self.kv = kv
        self.allow_direct = allow_direct
        self.sealer = sealer
        self.retry_for = retry_for
        self.direct = direct
        # How long one try of a write waits for its answer before it reads the key back and
        # tries again. An answer lost with a restarting server is otherwise waited for 5 s
        # (nats-py's default), and a worker whose heartbeat write waits that long looks dead
        # to the others: a worker sets this to a quarter of its lease.
        self.write_timeout = 5.0
        # The same for a read: a read sent while the bucket elects a leader may get no answer
        # at all, and the step that waits for it stands still (5 s by default) after the
        # election; given up sooner, the step is tried again once the leader is there.
        self.read_timeout = 5.0
        self._stream = f"KV_{bucket}"
        self._prefix = f"$KV.{bucket}."
        # Records whose seal verified, as decoded, by what the verdict depends on and nothing
        # else: the key, the stored bytes, the time the server stored them and the revision
        # their write replaced (``_decode``).
        self._verified: OrderedDict[tuple[str, bytes, float, int | None], BaseModel] = OrderedDict()
        # The reads of one turn's keys asked for in the same pass of the event loop, not yet
        # sent (``_shared_last``), by turn key.
        self._sharing: dict[str, _SharedRead] = {}
        self._reading: set[asyncio.Task[dict[str, Stored]]] = set()

    @classmethod
    async def open(cls, nc: Client, sealer: Sealer | None = None) -> StateStore:
        """The state bucket, read with batched direct gets where it allows them."""
        js = nc.jetstream()
        kv = await js.key_value(STATE_BUCKET)
        info = await js.stream_info(f"KV_{STATE_BUCKET}")
        direct = bool(info.config.allow_direct)
        return cls(js, kv, sealer, direct=nc if direct else None, allow_direct=direct)

    def _encode(self, key: str, value: BaseModel, replaces: int) -> bytes:
        """``value``'s stored bytes, sealed to be written over revision ``replaces`` (0: a
        key with no value) of ``key``."""
        if self.sealer is None:
            return encode(value)
        data = value.model_dump(mode="json", exclude_none=True)
        data.pop(SEAL_FIELD, None)
        body: bytes = msgpack.packb(data, use_bin_type=True)  # what the seal covers
        return with_seal(body, len(data), self.sealer.seal_packed(key, body, replaces))

    def _decode(self, model: type[R], key: str, raw: Stored, verify: bool) -> R:
        if self.sealer is None or not verify:
            return decode(model, raw.data)
        # A seal's verdict is a function of the key, the bytes and the stored time under this
        # store's keys, and so is the record they decode to: the same three read again (a
        # turn's record is read by every call step and join of the turn) are neither
        # verified nor validated a second time. Only verified records are remembered, and
        # every reader gets a copy of its own (records are never changed in place: a change
        # is a ``model_copy`` with its update, written back).
        seen = (key, raw.data, raw.stored_at, raw.replaced)
        known = self._verified.get(seen)
        if known is not None and type(known) is model:
            return _copy_of(known)
        try:
            data = msgpack.unpackb(raw.data, raw=False)
        except Exception as exc:
            raise SealBroken(key, f"it is not msgpack ({exc})") from exc
        if not isinstance(data, dict):
            raise SealBroken(key, "it is not a record")
        if known is None:
            why = self.sealer.verify(key, data, raw.stored_at, raw.replaced, raw.data)
            if why is not None:
                raise SealBroken(key, why)
        try:
            record = decode_map(model, data)
        except DecodeError as exc:
            raise SealBroken(key, str(exc)) from exc
        if len(self._verified) >= VERIFIED_MEMO:
            self._verified.popitem(last=False)  # the oldest
        self._verified[seen] = record
        return _copy_of(record)

    async def _get(self, model: type[R], key: str, verify: bool = True) -> Versioned[R] | None:
        return self._typed(model, key, await self._raw(key), verify)

    async def _raw(self, key: str) -> Stored | None:
        last = await self._last(key)
        return None if last is None or last[1] else last[0]

    async def _last(self, key: str) -> tuple[Stored, bool] | None:
        """The last message stored at ``key`` (None when there is none), and whether it is a
        delete or purge marker."""
        subject = self._prefix + key
        if self._gets is not None:
            found = await self._gets.last(self._stream, subject, self.read_timeout)
            if found is None:
                return None
            stored = _stored(found.data, found.seq, found.headers)
            return stored, _marker(found.headers)
        try:
            async with asyncio.timeout(self.read_timeout):
                msg = await self.js.get_msg(self._stream, subject=subject, direct=self.allow_direct)
        except NotFoundError:
            return None
        stored = _stored(msg.data or b"", msg.seq or 0, msg.headers)
        if msg.time is not None:
            stored = stored._replace(stored_at=msg.time.timestamp())
        return stored, _marker(msg.headers) or msg.data is None

    async def _raw_many(self, keys: Sequence[str], share: str | None = None) -> dict[str, Stored]:
        """The current value and revision of every key that has one, in one request (shared
        with the other reads of turn key ``share`` asked for now: ``_shared_last``; the
        answer may hold more keys than were asked for)."""
        if self._gets is None or len(keys) < 2:
            got = await asyncio.gather(*(self._raw(k) for k in keys))
            return {k: r for k, r in zip(keys, got, strict=True) if r is not None}
        if share is not None:
            return await self._shared_last(self._gets, share, keys, len(keys))
        return await self._direct_last(self._gets, keys, len(keys))

    async def _direct_last(
        self, gets: DirectGets, patterns: Sequence[str], most: int
    ) -> dict[str, Stored]:
        """One batched direct get of the last value of every key matching ``patterns``."""
        req = {"multi_last": [self._prefix + k for k in patterns], "batch": most}
        found, _ = await gets.batch(self._stream, req, self.read_timeout)
        out: dict[str, Stored] = {}
        for m in found:
            if not _marker(m.headers):
                out[m.subject.removeprefix(self._prefix)] = _stored(m.data, m.seq, m.headers)
        return out

    async def _shared_last(
        self, gets: DirectGets, group: str, patterns: Sequence[str], most: int
    ) -> dict[str, Stored]:
        """``_direct_last``, sent together with the other reads of ``group`` (a turn's key)
        asked for in the same pass of the event loop: one request, one answer per key.

        The steps of a turn a worker fetched together (a model step's parallel calls) read
        the turn, its session and their calls at once, and their joins read the turn and
        every call of the step at once: five requests, each answered with the same records,
        were five times the messages of one. A read that shares is sent after every read
        sharing it was asked for, so each gets what it would have got alone, or newer.
        Only the reads of one turn share: their keys were written close together, which
        keeps the server's lookup of them cheap."""
        shared = self._sharing.get(group)
        if shared is None:
            loop = running_loop()
            shared = self._sharing[group] = _SharedRead(loop.create_future())
            # Sent two passes later: the steps woken by the same answer (or fetched by the
            # same pull) run their reads in the next pass, after this one's.
            loop.call_soon(loop.call_soon, self._send_shared, gets, group)
        shared.patterns.update(dict.fromkeys(patterns))
        shared.most += most
        return await asyncio.shield(shared.answer)

    def _send_shared(self, gets: DirectGets, group: str) -> None:
        shared = self._sharing.pop(group)
        task = running_loop().create_task(
            self._direct_last(gets, list(shared.patterns), shared.most)
        )
        self._reading.add(task)  # a task only the loop refers to may be collected mid-read
        task.add_done_callback(self._reading.discard)
        task.add_done_callback(shared.settle)

    def _typed(
        self, model: type[R], key: str, raw: Stored | None, verify: bool = True
    ) -> Versioned[R] | None:
        if raw is None:
            return None
        return Versioned(self._decode(model, key, raw, verify), raw.revision, raw.stored_at)

    async def step_view(
        self, session_id: str, turn_id: str, call_key: str
    ) -> tuple[
        Versioned[TurnRecord] | None, Versioned[CallRecord] | None, Versioned[SessionRecord] | None
    ]:
        """What a call step reads before it decides: its turn, its call and its session."""
        tk, ck = turn_key(session_id, turn_id), call_state_key(call_key)
        sk = session_key(session_id)
        rk = _reads_key_of(call_key)
        raw = await self._raw_many([tk, ck, sk] + ([rk] if rk else []), share=tk)
        rec = self._typed(CallRecord, ck, raw.get(ck))
        if rec is None and rk is not None:
            rec = _kept_read(self._typed(StepReads, rk, raw.get(rk)), call_key)
        return (
            self._typed(TurnRecord, tk, raw.get(tk)),
            rec,
            self._typed(SessionRecord, sk, raw.get(sk)),
        )

    async def turn_view(
        self, session_id: str, turn_id: str
    ) -> tuple[Versioned[TurnRecord] | None, Versioned[SessionRecord] | None]:
        """A turn and its session (a model step's conversation needs both), in one request."""
        tk, sk = turn_key(session_id, turn_id), session_key(session_id)
        raw = await self._raw_many([tk, sk], share=tk)
        return self._typed(TurnRecord, tk, raw.get(tk)), self._typed(SessionRecord, sk, raw.get(sk))

    async def join_view(
        self, session_id: str, turn_id: str, model_step: int, most_calls: int = 1000
    ) -> tuple[Versioned[TurnRecord] | None, list[Versioned[CallRecord] | None]]:
        """A turn and the records of its step's calls (one per planned call, None where
        there is none yet), in one request where direct gets are allowed."""
        tk = turn_key(session_id, turn_id)
        rk = step_reads_key(session_id, turn_id, model_step)
        if self._gets is None:
            turn = await self.turn(session_id, turn_id)
            if turn is None:
                return None, []
            keys = [
                call_key(session_id, turn_id, model_step, i) for i in range(len(turn.value.calls))
            ]
            calls, reads = await asyncio.gather(self.calls(keys), self._get(StepReads, rk))
        else:
            step = call_state_key(f"{session_id}.{turn_id}.{model_step}")
            raw = await self._shared_last(self._gets, tk, [tk, f"{step}.*", rk], most_calls + 2)
            turn = self._typed(TurnRecord, tk, raw.get(tk))
            if turn is None:
                return None, []
            keys = [
                call_key(session_id, turn_id, model_step, i) for i in range(len(turn.value.calls))
            ]
            calls = [
                self._typed(CallRecord, call_state_key(k), raw.get(call_state_key(k))) for k in keys
            ]
            reads = self._typed(StepReads, rk, raw.get(rk))
        return turn, [
            c if c is not None else _kept_read(reads, k) for c, k in zip(calls, keys, strict=True)
        ]

    async def calls(self, call_keys: Sequence[str]) -> list[Versioned[CallRecord] | None]:
        """The records of several calls (a step's calls, for its join), in one request."""
        keys = [call_state_key(k) for k in call_keys]
        raw = await self._raw_many(keys)
        return [self._typed(CallRecord, k, raw.get(k)) for k in keys]

    async def _create(self, key: str, value: BaseModel, sent: list[bytes]) -> int:
        """Write ``value`` at ``key`` if it has no value: over nothing, or over the tombstone
        a deleted value left (sealed anew for that revision: a seal names what it replaces)."""
        data = self._encode(key, value, 0)
        sent.append(data)
        try:
            return await self._cas(key, data, 0)
        except Conflict:
            pass
        tombstone = await self._tombstone(key)
        if tombstone is None:
            raise Conflict(key, None)  # the key has a value
        data = self._encode(key, value, tombstone)
        sent.append(data)
        try:
            return await self._cas(key, data, tombstone)
        except Conflict:
            raise Conflict(key, None) from None

    async def _tombstone(self, key: str) -> int | None:
        """The revision of ``key``'s last message when that is a delete or purge marker."""
        last = await self._last(key)
        return last[0].revision if last is not None and last[1] else None

    async def _cas(self, key: str, data: bytes, revision: int) -> int:
        """One CAS publish into the bucket's stream (what ``kv.update`` sends, without its
        layers: a step makes several of these, each on the worker's CPU budget)."""
        headers = {EXPECTED_LAST: str(revision)}
        try:
            ack = await self._replies.publish(self._prefix + key, data, headers, self.write_timeout)
        except APIError as exc:
            if exc.err_code in WRONG_LAST_SEQUENCE:
                raise Conflict(key, revision or None) from exc
            raise
        return ack.seq

    async def write(self, key: str, value: BaseModel, revision: int | None) -> int:
        """Create when ``revision`` is None, else CAS-update from ``revision``.

        While the servers are between leaders (a restart, an election) the write is tried again for
        up to ``retry_for`` seconds, so a short outage does not fail the attempt (which a redelivery
        would then count as lost). A write whose answer was lost is read back: if the key holds
        exactly what we wrote, it landed — a retried CAS would answer "wrong last sequence" and look
        like a takeover (docs/design.md, JetStream facts). Each try is sealed anew (the seal holds
        the time it is written), so the read-back knows every version sent.
        """
        sent: list[bytes] = []
        tried = False

        async def landed() -> int | None:
            try:
                entry = await asyncio.wait_for(self.kv.get(key), self.read_timeout)
            except KeyNotFoundError:
                # Nothing there (deleted keys read so too): no try of ours landed. A server
                # cut off from its peers answers a create so while an earlier try is still
                # proposed: "wrong last sequence", and the key reads as never written.
                return None
            return entry.revision if entry.value in sent and entry.revision else None

        async def once() -> int:
            nonlocal tried
            again, tried = tried, True
            try:
                if revision is None:
                    return await self._create(key, value, sent)
                data = self._encode(key, value, revision)
                sent.append(data)
                return await self._cas(key, data, revision)
            except Conflict:
                if again and (rev := await landed()) is not None:
                    return rev  # our earlier try landed; its answer was lost
                raise
            except RETRYABLE as exc:
                try:
                    rev = await landed()
                except Exception:
                    raise exc from None
                if rev is not None:
                    return rev
                raise

        return await retrying(once, self.retry_for, "state write")

    async def revision(self, key: str) -> int | None:
        try:
            entry = await asyncio.wait_for(self.kv.get(key), self.read_timeout)
        except KeyNotFoundError:
            return None
        return entry.revision

    async def keys(self, pattern: str) -> list[str]:
        """Keys matching a subject-style pattern (``call.s1.t1.>``), read server-side filtered."""
        return await kvkeys.keys(self.kv, pattern)

    async def matching(self, pattern: str, most: int) -> tuple[dict[str, Stored], int]:
        """The current value of up to ``most`` keys matching ``pattern`` (``turn.s1.*``), and
        how many more match: one batched direct get where the bucket allows them, else the
        keys (read server-side filtered) and a get each. Decode each with ``typed``."""
        if self._gets is not None:
            req = {"multi_last": [self._prefix + pattern], "batch": most}
            found, left = await self._gets.batch(self._stream, req, self.read_timeout)
            out: dict[str, Stored] = {}
            for m in found:
                if not _marker(m.headers):
                    out[m.subject.removeprefix(self._prefix)] = _stored(m.data, m.seq, m.headers)
            return out, left
        keys = await self.keys(pattern)
        return await self._raw_many(keys[:most]), max(0, len(keys) - most)

    async def stored(self, key: str) -> Stored | None:
        """A key's current value as stored, not decoded yet (decode it with ``typed``)."""
        return await self._raw(key)

    def typed(
        self, model: type[R], key: str, raw: Stored | None, verify: bool = True
    ) -> Versioned[R] | None:
        """A stored value as its record, verified as every read is (``SealBroken``)."""
        return self._typed(model, key, raw, verify)

    async def session(
        self, session_id: str, verify: bool = True
    ) -> Versioned[SessionRecord] | None:
        return await self._get(SessionRecord, session_key(session_id), verify)

    async def turn(
        self, session_id: str, turn_id: str, verify: bool = True
    ) -> Versioned[TurnRecord] | None:
        return await self._get(TurnRecord, turn_key(session_id, turn_id), verify)

    async def call(self, call_key: str, verify: bool = True) -> Versioned[CallRecord] | None:
        """A call's record; for a read kept with its step's other reads, that record's entry
        (``StepReads``: done, never written again)."""
        found = await self._get(CallRecord, call_state_key(call_key), verify)
        rk = _reads_key_of(call_key)
        if found is not None or rk is None:
            return found
        return _kept_read(await self._get(StepReads, rk, verify), call_key)

    async def approval(self, session_id: str, approval_id: str) -> Versioned[ApprovalRecord] | None:
        return await self._get(ApprovalRecord, approval_key(session_id, approval_id))

    async def question(self, session_id: str, question_id: str) -> Versioned[QuestionRecord] | None:
        return await self._get(QuestionRecord, question_key(session_id, question_id))

    async def compaction(
        self, session_id: str, turn_id: str, model_step: int
    ) -> Versioned[CompactionRecord] | None:
        return await self._get(CompactionRecord, compaction_key(session_id, turn_id, model_step))
