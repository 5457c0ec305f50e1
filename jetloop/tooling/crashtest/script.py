"""What a crash test drives: the user's messages, and a scripted model when the app's own
cannot run offline.

**Messages** (``--messages FILE``): one user message per line (blank lines and lines that
start with ``#`` are skipped) for an app with one agent, or a JSON list of
``{"agent": "<name>", "text": "<message>"}``. A round sends them in order to one new
session, each after the turn before it ended.

**Model script** (``--model-script FILE``): JSON, a map from a user message's text to the
model's replies within that message's turn, in order:

    {
      "open a ticket for the broken printer": [
        {"calls": [{"tool": "create_ticket", "args": {"title": "broken printer"}}]},
        {"text": "Ticket opened."}
      ]
    }

A reply has ``text``, ``calls`` (each ``{"tool", "args"}``), or both; a reply without calls
is the turn's answer. A turn's ``n``-th model step gets the ``n``-th reply; past the end of
the list, and for a message the script does not name, the model answers that the script has
nothing more (the turn ends). Every agent of the app answers from the script.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jetloop.agents.model import ModelRequest, ModelResponse, ScriptedModel, ToolCallRequest


@dataclass(frozen=True)
class Message:
    agent: str | None  # None: the app's one agent
    text: str


class ScriptError(ValueError):
    """A messages or model-script file that cannot be read as documented: names the file."""


def read_messages(path: Path) -> list[Message]:
    """The messages of a file: a JSON list of ``{agent, text}``, JSON Lines (one such object
    a line), or plain text (a message a line, ``#`` comments); anything else that looks like
    JSON is an error, never sent as text."""
    raw = path.read_text()
    lines = [
        (n, ln.strip())
        for n, ln in enumerate(raw.splitlines(), 1)
        if ln.strip() and not ln.lstrip().startswith("#")
    ]
    if raw.lstrip().startswith("["):
        try:
            items = json.loads(raw)
            if not isinstance(items, list):
                raise TypeError("not a list")
            out = [_message(i) for i in items]
        except (ValueError, TypeError, KeyError) as exc:
            raise ScriptError(f"{path}: expected a JSON list of {{agent, text}}: {exc}") from None
    elif lines and lines[0][1].startswith("{"):
        try:
            whole = json.loads(raw)
        except ValueError:
            whole = None
        if isinstance(whole, dict) and len(lines) > 1:
            raise ScriptError(
                f"{path}: one JSON object over several lines: give a JSON list of "
                "{agent, text} ([...]), or one object a line (JSON Lines)"
            )
        out = []
        for n, ln in lines:
            try:
                out.append(_message(json.loads(ln)))
            except (ValueError, TypeError, KeyError) as exc:
                raise ScriptError(
                    f"{path}:{n}: JSON Lines expected (one {{agent, text}} object a line): {exc}"
                ) from None
    else:
        out = [Message(None, ln) for _, ln in lines]
    if not out:
        raise ScriptError(f"{path}: no messages")
    return out


def _message(item: object) -> Message:
    if not isinstance(item, dict):
        raise TypeError(f"{item!r} is not an object with agent and text")
    text = item["text"]
    if not isinstance(text, str):
        raise TypeError(f"text {text!r} is not a string")
    return Message(str(item["agent"]), text)


def messages_of(items: list[str] | list[dict[str, str]] | list[Message]) -> list[Message]:
    """Messages given in Python: texts, ``{"agent", "text"}`` maps, or ``Message``s."""
    out: list[Message] = []
    for i in items:
        if isinstance(i, Message):
            out.append(i)
        elif isinstance(i, str):
            out.append(Message(None, i))
        else:
            out.append(Message(i.get("agent"), i["text"]))
    if not out:
        raise ScriptError("no messages")
    return out


def read_script(path: Path) -> dict[str, list[dict[str, Any]]]:
    try:
        body = json.loads(path.read_text())
    except ValueError as exc:
        raise ScriptError(f"{path}: not JSON: {exc}") from None
    if not isinstance(body, dict) or not all(
        isinstance(v, list) and all(isinstance(r, dict) for r in v) for v in body.values()
    ):
        raise ScriptError(f"{path}: expected {{message text: [reply, …]}}, each reply an object")
    for text, replies in body.items():
        for r in replies:
            for c in r.get("calls", []):
                if not isinstance(c, dict) or "tool" not in c:
                    raise ScriptError(f"{path}: a call in the replies to {text!r} has no tool")
    return body


def _per_session(value: Any, session_id: str) -> Any:
    """``value`` with ``{session}`` in its strings replaced by the session id: the crash
    test's sessions run side by side, and a stateful tool (a file, a repository, an account)
    then works on a thing of each session's own."""
    if isinstance(value, str):
        return value.replace(SESSION_PLACEHOLDER, session_id)
    if isinstance(value, dict):
        return {k: _per_session(v, session_id) for k, v in value.items()}
    if isinstance(value, list):
        return [_per_session(v, session_id) for v in value]
    return value


# In a model script's call arguments: the id of the session the call is made in.
SESSION_PLACEHOLDER = "{session}"


def scripted_model(script: dict[str, list[dict[str, Any]]]) -> ScriptedModel:
    def reply(req: ModelRequest) -> ModelResponse:
        start = max((i for i, m in enumerate(req.messages) if m.role == "user"), default=None)
        if start is None:
            return ModelResponse(text="(the model script has nothing without a message)")
        text = req.messages[start].text or ""
        steps = sum(1 for m in req.messages[start:] if m.role == "assistant")
        replies = script.get(text)
        if not replies:
            return ModelResponse(text=f"(the model script has no replies to {text!r})")
        if steps >= len(replies):
            return ModelResponse(text=f"(the model script has no more replies to {text!r})")
        r = replies[steps]
        calls = [
            ToolCallRequest(
                name=str(c["tool"]),
                arguments=_per_session(dict(c.get("args", {})), req.session_id),
            )
            for c in r.get("calls", [])
        ]
        return ModelResponse(text=str(r.get("text", "")), tool_calls=calls)

    return ScriptedModel(reply)
