"""What a crash test reads: the messages file and the model script (no server needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jetloop.agents.model import Message as Said
from jetloop.agents.model import ModelRequest
from jetloop.tooling.crashtest.script import (
    Message,
    ScriptError,
    read_messages,
    read_script,
    scripted_model,
)


def test_messages_are_lines_or_a_json_list(tmp_path: Path) -> None:
    """Lines (blank ones and ``#`` comments skipped) for an app with one agent; a JSON list
    of {agent, text} names each message's agent; an empty or malformed file names itself."""
    lines = tmp_path / "m.txt"
    lines.write_text("# a comment\nrefund order 42\n\n  refund order 43  \n")
    assert read_messages(lines) == [
        Message(None, "refund order 42"),
        Message(None, "refund order 43"),
    ]
    listed = tmp_path / "m.json"
    listed.write_text(json.dumps([{"agent": "shop", "text": "hi"}]))
    assert read_messages(listed) == [Message("shop", "hi")]
    listed.write_text('[{"text": "no agent"}]')
    with pytest.raises(ScriptError, match=r"m\.json"):
        read_messages(listed)
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(ScriptError, match="no messages"):
        read_messages(tmp_path / "empty.txt")


def test_json_that_is_no_list_is_read_as_lines_of_json_or_refused(tmp_path: Path) -> None:
    """JSON Lines (one {agent, text} a line) are messages; one JSON object, over one line or
    several, or a line of JSON Lines that is not one, is refused with where it is: never
    sent to the agent as raw text (before: the object's text was the message)."""
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text(
        '{"agent": "shop", "text": "hi"}\n# a comment\n{"agent": "crm", "text": "yo"}\n'
    )
    assert read_messages(jsonl) == [Message("shop", "hi"), Message("crm", "yo")]
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"agent": "shop", "text": "hi"}, indent=2))
    with pytest.raises(ScriptError, match=r"one\.json: one JSON object over several lines"):
        read_messages(one)
    jsonl.write_text('{"agent": "shop", "text": "hi"}\n{"agent": "shop", "text": \n')
    with pytest.raises(ScriptError, match=r"m\.jsonl:2: JSON Lines expected"):
        read_messages(jsonl)
    jsonl.write_text('{"text": "no agent"}\n')
    with pytest.raises(ScriptError, match=r"m\.jsonl:1: JSON Lines expected"):
        read_messages(jsonl)


def request(*said: Said) -> ModelRequest:
    return ModelRequest(agent="shop", instructions="", messages=list(said), tools=[], attempt=1)


async def test_the_model_script_answers_each_step_of_its_message(tmp_path: Path) -> None:
    """The n-th model step of a message's turn gets the n-th reply; past the end, and for a
    message the script does not name, the model says so and the turn ends."""
    path = tmp_path / "script.json"
    path.write_text(
        json.dumps(
            {
                "refund order 42": [
                    {"calls": [{"tool": "refund", "args": {"order": "42"}}]},
                    {"text": "Refunded."},
                ]
            }
        )
    )
    model = scripted_model(read_script(path))
    first = await model.complete(request(Said("user", "refund order 42")))
    assert [(c.name, c.arguments) for c in first.tool_calls] == [("refund", {"order": "42"})]
    asked = Said("assistant", calls=first.tool_calls)
    second = await model.complete(
        request(Said("user", "refund order 42"), asked, Said("tool", tool="refund", result={}))
    )
    assert second.text == "Refunded." and not second.tool_calls
    third = await model.complete(
        request(Said("user", "refund order 42"), asked, Said("assistant", text="Refunded."))
    )
    assert "no more replies" in third.text and not third.tool_calls
    other = await model.complete(request(Said("user", "something else")))
    assert "no replies" in other.text and not other.tool_calls


def test_a_script_that_is_not_the_documented_shape_names_its_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    for body in ("not json", '["a list"]', '{"m": [{"calls": [{"args": {}}]}]}'):
        path.write_text(body)
        with pytest.raises(ScriptError, match=r"bad\.json"):
            read_script(path)


async def test_the_model_script_gives_each_session_its_own_arguments() -> None:
    """``{session}`` in a scripted call's arguments is the session's id, in nested values
    too: sessions of a crash test that run side by side work on things of their own."""
    model = scripted_model(
        {
            "commit": [
                {
                    "calls": [
                        {
                            "tool": "git_commit",
                            "args": {"repo": "/r/{session}", "n": 1, "tags": ["{session}-a"]},
                        }
                    ]
                }
            ]
        }
    )
    req = ModelRequest(
        agent="shop",
        instructions="",
        messages=[Said(role="user", text="commit")],
        tools=[],
        attempt=1,
        session_id="k3",
    )
    (made,) = (await model.complete(req)).tool_calls
    assert made.arguments == {"repo": "/r/k3", "n": 1, "tags": ["k3-a"]}


async def test_a_scripted_model_counts_as_a_model_with_tokens() -> None:
    """A user's ``ScriptedModel`` is model ``scripted`` in the usage ledger (or the name it
    is given), with the tokens its script reports, else an estimate (before: ``unknown``,
    0 tokens)."""
    from jetloop.agents.model import ModelResponse, ScriptedModel
    from jetloop.consumers.usage import model_of

    req = ModelRequest(
        agent="shop",
        instructions="Help.",
        messages=[Said(role="user", text="refund order 42 please")],
        tools=[],
        attempt=1,
    )
    plain = ScriptedModel(lambda r: ModelResponse(text="Refunded order 42."))
    out = await plain.complete(req)
    assert out.usage["input_tokens"] > 0 and out.usage["output_tokens"] > 0
    assert model_of(plain, out) == "scripted"
    told = ScriptedModel(
        lambda r: ModelResponse(text="x", usage={"input_tokens": 7, "output_tokens": 3}),
        model="gpt-4o-mini",
    )
    out = await told.complete(req)
    assert out.usage == {"input_tokens": 7, "output_tokens": 3}
    assert model_of(told, out) == "gpt-4o-mini"
