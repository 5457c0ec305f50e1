"""Reading a session's conversation back from ``JL_EVENTS``.

History is append-only and written after the checkpoint that decided it (rule 6): a step
never rewrites the conversation. A reader keeps the first entry of each key, so an entry
re-published after the dedupe window has passed is still read once; an entry that holds a
step's results (``HistoryEntry.parts``) is read as its parts, each kept by its own key.
Each worker keeps the tail it has seen per session, so a model step reads only what was
appended since.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.js.errors import NotFoundError

from jetloop.schemas import HistoryEntry, decode
from jetloop.streams.direct import direct_batch
from jetloop.streams.topology import EVENTS_STREAM, history_filter

BATCH = 256


@dataclass
class _Tail:
    next_seq: int = 1
    entries: list[HistoryEntry] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)


class HistoryReader:
    """Reads with batched direct gets where the stream allows them (one replica), else
    with gets the stream leader answers (R3: a follower could be behind)."""

    def __init__(
        self, nc: Client, direct: bool = True, cache_sessions: int = 512, timeout: float = 5.0
    ) -> None:
        self.nc = nc
        self.direct = direct
        self.timeout = timeout
        self.cache_sessions = cache_sessions
        self._tails: OrderedDict[str, _Tail] = OrderedDict()

    @classmethod
    async def for_stream(cls, nc: Client, timeout: float = 5.0) -> HistoryReader:
        """``timeout``: how long one read waits for its answer (a worker: a quarter of its
        lease, so a read lost in an election is tried again soon after it)."""
        info = await nc.jetstream().stream_info(EVENTS_STREAM)
        return cls(nc, direct=bool(info.config.allow_direct), timeout=timeout)

    async def read(self, session_id: str) -> list[HistoryEntry]:
        tail = self._tails.pop(session_id, None) or _Tail()
        self._tails[session_id] = tail
        while len(self._tails) > self.cache_sessions:
            self._tails.popitem(last=False)
        if not self.direct:
            await self._read_from_leader(session_id, tail)
            return list(tail.entries)
        while True:
            pending = await self._read_batch(session_id, tail)
            if pending == 0:
                break
        return list(tail.entries)

    def _keep(self, tail: _Tail, seq: int, data: bytes) -> None:
        tail.next_seq = seq + 1
        for entry in decode(HistoryEntry, data).each():
            if entry.key not in tail.keys:
                tail.keys.add(entry.key)
                tail.entries.append(entry)

    async def _read_from_leader(self, session_id: str, tail: _Tail) -> None:
        js = self.nc.jetstream()
        while True:
            try:
                msg = await asyncio.wait_for(
                    js.get_msg(
                        EVENTS_STREAM,
                        seq=tail.next_seq,
                        subject=history_filter(session_id),
                        next=True,
                    ),
                    self.timeout,
                )
            except NotFoundError:
                return
            assert msg.seq is not None
            self._keep(tail, msg.seq, msg.data or b"")

    async def _read_batch(self, session_id: str, tail: _Tail) -> int:
        """One batched direct get; returns how many matching messages remain after it."""
        req = {"seq": tail.next_seq, "next_by_subj": history_filter(session_id), "batch": BATCH}
        found, pending = await direct_batch(self.nc, EVENTS_STREAM, req, self.timeout)
        for m in found:
            self._keep(tail, m.seq, m.data)
        return pending
