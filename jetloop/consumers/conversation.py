"""What the model is given: a session's history as messages, converted once per worker.

History is append-only (rule 6) and the history reader keeps each session's tail, so a
model step converts only the entries appended since the last one it saw. Entries whose
payload lives in ``jl_blobs`` are resolved on every use instead of being kept in memory.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Literal

from jetloop.agents import Message
from jetloop.schemas import HistoryEntry, HistoryRole, SessionRecord
from jetloop.streams.state import Versioned

if TYPE_CHECKING:
    from jetloop.consumers.runtime import Runtime


class MessageCache:
    """Per session, the converted message of every history entry (None for summaries),
    with the entry's key to tell that the history is the one it was built from."""

    def __init__(self, sessions: int = 512) -> None:
        self.sessions = sessions
        self._by_session: OrderedDict[str, list[tuple[str, Message | HistoryEntry | None]]] = (
            OrderedDict()
        )

    def take(self, session_id: str, history: list[HistoryEntry]) -> list[Any]:
        got = self._by_session.pop(session_id, None) or []
        if len(got) > len(history) or (got and got[-1][0] != history[len(got) - 1].key):
            got = []  # not a prefix of this history: start again
        self._by_session[session_id] = got
        while len(self._by_session) > self.sessions:
            self._by_session.popitem(last=False)
        return got


async def message_of(rt: Runtime, e: HistoryEntry) -> Message:
    text = e.text
    if e.text_ref is not None:
        text = (await rt.blobs.get(e.text_ref)).decode()
    result: Any = e.result
    if e.result_ref is not None:
        result = json.loads(await rt.blobs.get(e.result_ref))
    return Message.from_entry(e, text, result)


# A call's result entry: ``<session>.<turn>.m<model step>.c<index>.result``.
_RESULT = re.compile(r".*\.m(\d+)\.c(\d+)\.result")


def _call_of(item: tuple[str, Any]) -> tuple[int, int]:
    found = _RESULT.fullmatch(item[0])
    assert found is not None
    return int(found[1]), int(found[2])


def in_call_order(items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``items`` (history keys and what they became) with each run of call results in the
    order of the calls: the folded log stores a step's results as the calls end, the
    separate log in call order, and the model is given the same either way."""
    out: list[tuple[str, Any]] = []
    run: list[tuple[str, Any]] = []
    for item in items:
        if _RESULT.fullmatch(item[0]):
            run.append(item)
            continue
        out += sorted(run, key=_call_of)
        run = []
        out.append(item)
    return out + sorted(run, key=_call_of)


async def conversation(
    rt: Runtime,
    session_id: str,
    upto: int | None = None,
    session: Versioned[SessionRecord] | Literal["read"] | None = "read",
    history: list[HistoryEntry] | None = None,
) -> list[Message]:
    """What the model sees: the stored summary, then the entries it does not cover.
    ``session`` is the session record and ``history`` the session's history when the
    caller read them already."""
    if history is None:
        history = await rt.history.read(session_id)
    if session == "read":
        session = await rt.state.session(session_id)
    summary = session.value.summary if session else None
    end = len(history) if upto is None else upto
    start = 0
    out: list[Message] = []
    if summary is not None and summary.covers <= end:
        out.append(Message(role=HistoryRole.SUMMARY.value, text=summary.text))
        start = summary.covers
    converted = rt.messages.take(session_id, history)
    for e in history[len(converted) :]:
        # Summary entries in the log are the record of a compaction; the session's summary
        # (above) is what the model is given.
        if e.role == HistoryRole.SUMMARY:
            converted.append((e.key, None))
        elif e.text_ref is not None or e.result_ref is not None:
            converted.append((e.key, e))  # resolved when used, not kept
        else:
            converted.append((e.key, await message_of(rt, e)))
    for _, m in in_call_order(converted[start:end]):
        if isinstance(m, HistoryEntry):
            out.append(await message_of(rt, m))
        elif m is not None:
            out.append(m)
    return out
