"""Reading a session's conversation back from ``JL_EVENTS``.

History is append-only and written after the checkpoint that decided it (rule 6): a step
never rewrites the conversation. A reader keeps the first entry of each key, so an entry
re-published after the dedupe window has passed is still read once. Each worker keeps the
tail it has seen per session, so a model step reads only what was appended since.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field

from nats.aio.client import Client

from schemas import HistoryEntry, decode
from streams.topology import EVENTS_STREAM, history_filter

BATCH = 256


@dataclass
class _Tail:
    next_seq: int = 1
    entries: list[HistoryEntry] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)


class HistoryReader:
    def __init__(self, nc: Client, cache_sessions: int = 512, timeout: float = 5.0) -> None:
        self.nc = nc
        self.timeout = timeout
        self.cache_sessions = cache_sessions
        self._tails: OrderedDict[str, _Tail] = OrderedDict()

    async def read(self, session_id: str) -> list[HistoryEntry]:
        tail = self._tails.pop(session_id, None) or _Tail()
        self._tails[session_id] = tail
        while len(self._tails) > self.cache_sessions:
            self._tails.popitem(last=False)
        while True:
            pending = await self._read_batch(session_id, tail)
            if pending == 0:
                break
        return list(tail.entries)

    async def _read_batch(self, session_id: str, tail: _Tail) -> int:
        """One batched direct get; returns how many matching messages remain after it."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        try:
            req = {"seq": tail.next_seq, "next_by_subj": history_filter(session_id), "batch": BATCH}
            await self.nc.publish(
                f"$JS.API.DIRECT.GET.{EVENTS_STREAM}", json.dumps(req).encode(), reply=inbox
            )
            while True:
                msg = await sub.next_msg(timeout=self.timeout)
                hdrs = msg.headers or {}
                status = hdrs.get("Status")
                if status == "404":
                    return 0
                if status:
                    if status != "204":
                        raise RuntimeError(f"history read failed: {status} {hdrs}")
                    return int(hdrs.get("Nats-Num-Pending", "0"))
                seq = int(hdrs["Nats-Sequence"])
                tail.next_seq = seq + 1
                entry = decode(HistoryEntry, msg.data)
                if entry.key not in tail.keys:
                    tail.keys.add(entry.key)
                    tail.entries.append(entry)
        finally:
            await sub.unsubscribe()
