"""One jetloop history, many providers: pair each call with its result and name both.

Every adapter first turns ``ModelRequest.messages`` into a short list of provider-neutral
items (``UserText``, ``Context``, ``Exchange``), then renders those in its own wire format.
Pairing and naming happen here once, so the three providers can never disagree about them.

Pairing. The engine writes an assistant message (its text and calls, each call with the
``provider_id`` the provider gave it) and later one tool message per call, whose ``call_id`` is
the engine's call id ``<turn>-<step>-<index>``. The results of an assistant message are the tool
messages after it, up to the next user or assistant message. Result ``r`` answers call
``calls[index]`` when the engine id's last part is that index and the tool names agree; a result
whose id does not parse takes the first unanswered call of its tool. A result that answers no
call becomes context text; a call without a result (its turn was cancelled or failed before the
results were written) gets a synthetic "no result was recorded" result, because every provider
rejects a call left unanswered. Notes written between a call and its results are moved after
the results, where each provider allows text.

Naming. The id sent for a call (and for its result) is the call's ``provider_id`` when that is
valid everywhere (``^[A-Za-z0-9_-]{1,40}$``: Anthropic's charset, OpenAI's length limit), not
positional (``call_0``, ``functions.get:0`` — some servers repeat these every turn) and not used
earlier in the request. Otherwise it is minted from the engine's identity: ``jl_<engine call
id>`` (or ``jl_`` and a digest of it when that would be too long), ``jl_m<message>_c<index>`` for
a call without a result, with ``_2``, ``_3``… on a clash. The same history always yields the
same ids, so a provider's prompt cache sees a stable prefix. This keeps "keys from identity"
(docs/design.md): the provider's id is only ever handed back to the provider; what pairs a
result with its call is the engine's call id.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jetloop.agents.model import Message, ToolCallRequest

VALID_ID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
POSITIONAL_ID = re.compile(r"^(?:call|tool|toolu|fc)?[_-]?\d+$|^functions\.[^:]*:\d+$")
ENGINE_CALL_ID = re.compile(r"^.+-\d+-(?P<index>\d+)$")

SUMMARY_PREFIX = "Summary of the earlier conversation (the messages it covers are not shown):\n"
NOTE_PREFIX = "Note from the system running this conversation (not from the user):\n"
SUMMARY_REQUEST = "Write the summary now, as the instructions say."

# What the model is told for each non-ok status: it must know whether the call had an effect.
STATUS_TEXT = {
    "error": "Error: the tool call failed.",
    "outcome_unknown": (
        "Outcome unknown: the call may or may not have taken effect, and it was not sent "
        "again. Check its effect before repeating it."
    ),
    "denied": "Denied: the call was not run because it was not approved.",
    "cancelled": (
        "Cancelled: the call was stopped before it completed; it may not have taken effect."
    ),
}
NO_RESULT = (
    "No result was recorded for this call: the turn ended before it finished, so it may or "
    "may not have taken effect."
)


@dataclass(frozen=True)
class UserText:
    text: str


@dataclass(frozen=True)
class Context:
    """Text from the engine (a note, the summary, a stray result): not the user's words."""

    text: str


@dataclass(frozen=True)
class WireCall:
    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return dumps(self.arguments)


@dataclass(frozen=True)
class WireResult:
    call_id: str
    name: str
    status: str
    content: str
    is_error: bool


@dataclass(frozen=True)
class Exchange:
    """An assistant message, then the results of its calls in call order."""

    text: str
    calls: tuple[WireCall, ...] = ()
    results: tuple[WireResult, ...] = ()


Item = UserText | Context | Exchange


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def result_content(status: str, text: str | None, result: Any) -> str:
    """The text a model reads for one tool result."""
    body = None if result is None else (result if isinstance(result, str) else dumps(result))
    if status == "ok":
        return body if body is not None else (text or "(the tool returned nothing)")
    parts = [STATUS_TEXT.get(status, f"Status {status}.")]
    if text:
        parts.append(f"Details: {text}")
    if body is not None:
        parts.append(f"Result: {body}")
    return "\n".join(parts)


def conversation(
    messages: Sequence[Message], *, tools_enabled: bool = True, summary: bool = False
) -> list[Item]:
    """The provider-neutral items for ``messages`` (see the module docstring for the rules).

    ``tools_enabled=False`` (a request without tools, such as the summary call) writes calls
    and results as text, since providers reject tool blocks in a request that defines no tools.
    ``summary=True`` ends the items with a user request to summarise, because a conversation
    ending on an assistant message would be continued rather than summarised.
    """
    ids = _Ids()
    items: list[Item] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        if m.role == "user":
            items.append(UserText(m.text or ""))
        elif m.role in ("note", "summary"):
            items.append(_context(m))
        elif m.role == "tool":
            items.append(_stray(m))
        elif m.role == "assistant":
            j = i + 1
            results: list[Message] = []
            deferred: list[Item] = []
            while j < len(messages) and messages[j].role in ("tool", "note", "summary"):
                if messages[j].role == "tool":
                    results.append(messages[j])
                else:
                    deferred.append(_context(messages[j]))
                j += 1
            items += _exchange(i, m, results, ids)
            items += deferred
            i = j
            continue
        else:
            raise ValueError(f"message {i} has unknown role {m.role!r}")
        i += 1
    if not tools_enabled:
        items = _as_text(items)
    if summary and not (items and isinstance(items[-1], UserText)):
        items.append(UserText(SUMMARY_REQUEST))
    return items


def _context(m: Message) -> Context:
    prefix = SUMMARY_PREFIX if m.role == "summary" else NOTE_PREFIX
    return Context(prefix + (m.text or ""))


def _stray(m: Message) -> Context:
    content = result_content(m.status or "ok", m.text, m.result)
    return Context(f"A result of tool {m.tool} that answers no call shown here:\n{content}")


def _exchange(position: int, m: Message, results: list[Message], ids: _Ids) -> list[Item]:
    answers: list[Message | None] = [None] * len(m.calls)
    leftovers: list[Message] = []
    for r in results:
        k = _engine_index(r.call_id)
        if k is not None and k < len(m.calls) and answers[k] is None and _fits(r, m.calls[k]):
            answers[k] = r
        else:
            leftovers.append(r)
    stray: list[Item] = []
    for r in leftovers:
        free = [k for k, a in enumerate(answers) if a is None and _fits(r, m.calls[k])]
        if free:
            answers[free[0]] = r
        else:
            stray.append(_stray(r))
    calls: list[WireCall] = []
    wire_results: list[WireResult] = []
    for k, (call, answer) in enumerate(zip(m.calls, answers, strict=True)):
        engine_id = answer.call_id if answer is not None else None
        wid = ids.assign(call.provider_id, engine_id, f"m{position}_c{k}")
        calls.append(WireCall(wid, call.name, dict(call.arguments)))
        if answer is None:
            wire_results.append(WireResult(wid, call.name, "unknown", NO_RESULT, True))
        else:
            status = answer.status or "ok"
            content = result_content(status, answer.text, answer.result)
            wire_results.append(WireResult(wid, call.name, status, content, status != "ok"))
    out: list[Item] = []
    if m.text or calls:
        out.append(Exchange(m.text or "", tuple(calls), tuple(wire_results)))
    return out + stray


def _fits(result: Message, call: ToolCallRequest) -> bool:
    return result.tool is None or result.tool == call.name


def _engine_index(call_id: str | None) -> int | None:
    match = ENGINE_CALL_ID.match(call_id or "")
    return int(match["index"]) if match else None


def _as_text(items: list[Item]) -> list[Item]:
    out: list[Item] = []
    for item in items:
        if not isinstance(item, Exchange) or not item.calls:
            out.append(item)
            continue
        lines = [item.text] if item.text else []
        lines += [f"[called {c.name} with {c.arguments_json}]" for c in item.calls]
        out.append(Exchange("\n".join(lines)))
        out.append(Context("\n".join(f"[result of {r.name}]\n{r.content}" for r in item.results)))
    return out


@dataclass
class _Ids:
    """Hands out the wire id of each call in one request (rules in the module docstring)."""

    seen: set[str] = field(default_factory=set)

    def assign(self, provider_id: str | None, engine_id: str | None, position: str) -> str:
        if (
            provider_id
            and VALID_ID.match(provider_id)
            and not POSITIONAL_ID.match(provider_id)
            and provider_id not in self.seen
        ):
            return self._take(provider_id)
        if engine_id:
            candidate = f"jl_{engine_id}"
            if not VALID_ID.match(candidate):
                candidate = "jl_" + hashlib.blake2b(engine_id.encode(), digest_size=12).hexdigest()
        else:
            candidate = f"jl_{position}"
        base, n = candidate, 1
        while candidate in self.seen:
            n += 1
            candidate = f"{base[: 40 - len(str(n)) - 1]}_{n}"
        return self._take(candidate)

    def _take(self, wire_id: str) -> str:
        self.seen.add(wire_id)
        return wire_id
