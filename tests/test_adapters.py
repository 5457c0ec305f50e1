"""Provider adapters against fake provider servers that speak each wire format exactly.

Each fake checks requests the way its provider does (tool-call pairing, id charset, headers)
and answers a broken one with the provider's own 400, so a passing round trip means the
payload would be accepted. No network beyond 127.0.0.1, no sleeps: a timeout test waits on
the adapter's own (short) timeout against a server that never answers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from jetloop.agents import (
    Agent,
    Message,
    ModelAdapter,
    ModelRequest,
    ModelResponse,
    ToolCallRequest,
    ToolSpec,
)
from jetloop.agents.adapters import (
    AnthropicAdapter,
    HttpAdapter,
    MalformedToolCall,
    OpenAIChatAdapter,
    OpenAIResponsesAdapter,
    adapter_from_spec,
)
from jetloop.agents.adapters.base import retry_after, sse_events
from jetloop.agents.adapters.history import NO_RESULT, NOTE_PREFIX, STATUS_TEXT, SUMMARY_REQUEST
from jetloop.schemas.errors import ProviderRejected, ProviderRetryable
from tests.fakes import (
    Failure,
    FakeAnthropic,
    FakeCall,
    FakeOpenAIChat,
    FakeOpenAIResponses,
    FakeProvider,
    Raw,
    Reply,
    Stall,
)

INSTRUCTIONS = "You help people with their tickets."
TICKET = {"type": "object", "properties": {"ticket": {"type": "string"}}, "required": ["ticket"]}
TITLE = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
TOOLS = [
    ToolSpec("create_ticket", "Open a ticket.", TITLE),
    ToolSpec("get_ticket", "Read one ticket.", TICKET),
    ToolSpec("close_ticket", "Close a ticket.", TICKET),
]
KINDS = ["openai_chat", "openai_responses", "anthropic"]
FAKES: dict[str, type[FakeProvider]] = {
    "openai_chat": FakeOpenAIChat,
    "openai_responses": FakeOpenAIResponses,
    "anthropic": FakeAnthropic,
}
ADAPTERS: dict[str, type[HttpAdapter]] = {
    "openai_chat": OpenAIChatAdapter,
    "openai_responses": OpenAIResponsesAdapter,
    "anthropic": AnthropicAdapter,
}


@dataclass
class Kit:
    kind: str
    fake: FakeProvider
    adapter: HttpAdapter


@pytest.fixture(params=KINDS)
async def kit(request: pytest.FixtureRequest) -> AsyncIterator[Kit]:
    kind: str = request.param
    async with FAKES[kind]() as fake:
        adapter = ADAPTERS[kind]("model-x", api_key=fake.api_key, base_url=fake.base_url)
        async with adapter:
            yield Kit(kind, fake, adapter)


# -- building histories the way the engine writes them --------------------------------------


def user(text: str) -> Message:
    return Message(role="user", text=text)


def note(text: str) -> Message:
    return Message(role="note", text=text)


def assistant(text: str, *calls: tuple[str, dict[str, Any], str | None]) -> Message:
    return Message(
        role="assistant",
        text=text,
        calls=[ToolCallRequest(name, args, pid) for name, args, pid in calls],
    )


def result(
    call_id: str, tool: str, status: str = "ok", value: Any = None, text: str | None = None
) -> Message:
    return Message(role="tool", call_id=call_id, tool=tool, status=status, result=value, text=text)


def ask(*messages: Message, tools: list[ToolSpec] = TOOLS, purpose: str = "answer") -> ModelRequest:
    return ModelRequest(
        agent="support",
        instructions=INSTRUCTIONS,
        messages=list(messages),
        tools=tools,
        attempt=1,
        purpose=purpose,
    )


def wire_calls(kind: str, body: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """(id, name, arguments) of every call and (id, content, is_error) of every result sent."""
    calls: list[Any] = []
    results: list[Any] = []
    if kind == "openai_chat":
        for m in body["messages"]:
            for c in m.get("tool_calls") or []:
                args = json.loads(c["function"]["arguments"])
                calls.append((c["id"], c["function"]["name"], args))
            if m["role"] == "tool":
                results.append((m["tool_call_id"], m["content"], None))
    elif kind == "openai_responses":
        for item in body["input"]:
            if item.get("type") == "function_call":
                calls.append((item["call_id"], item["name"], json.loads(item["arguments"])))
            elif item.get("type") == "function_call_output":
                results.append((item["call_id"], item["output"], None))
    else:
        for m in body["messages"]:
            for b in m["content"]:
                if b["type"] == "tool_use":
                    calls.append((b["id"], b["name"], b["input"]))
                elif b["type"] == "tool_result":
                    results.append((b["tool_use_id"], b["content"], b.get("is_error", False)))
    return calls, results


def texts(kind: str, body: dict[str, Any]) -> list[str]:
    """Every plain text the provider receives, in order (instructions excluded)."""
    if kind == "openai_responses":
        return [i["content"] for i in body["input"] if "role" in i and i["content"]]
    if kind == "openai_chat":
        return [m["content"] for m in body["messages"][1:] if m["role"] != "tool" and m["content"]]
    return [b["text"] for m in body["messages"] for b in m["content"] if b["type"] == "text"]


# -- plain answers and tool calls -----------------------------------------------------------


async def test_plain_answer(kit: Kit) -> None:
    """A text answer comes back with its token usage; the instructions go where each API wants."""
    kit.fake.script(Reply(text="Hello there.", usage=(21, 4)))
    response = await kit.adapter.complete(ask(user("hi")))
    assert response == ModelResponse(
        text="Hello there.", usage={"input_tokens": 21, "output_tokens": 4}
    )
    body = kit.fake.bodies[0]
    assert body["model"] == "model-x"
    assert "stream" not in body
    if kit.kind == "openai_chat":
        assert body["messages"][0] == {"role": "system", "content": INSTRUCTIONS}
    elif kit.kind == "openai_responses":
        assert body["instructions"] == INSTRUCTIONS and body["store"] is False
    else:
        assert body["system"] == INSTRUCTIONS and body["max_tokens"] == 4096


async def test_parallel_tool_calls(kit: Kit) -> None:
    """Several calls in one answer come back in order, each with the provider's own id."""
    kit.fake.script(
        Reply(
            text="On it.",
            calls=(
                FakeCall("create_ticket", {"title": "printer"}),
                FakeCall("get_ticket", {"ticket": "T-9"}),
            ),
        )
    )
    response = await kit.adapter.complete(ask(user("open one, look up T-9")))
    assert response.text == "On it."
    assert [(c.name, c.arguments) for c in response.tool_calls] == [
        ("create_ticket", {"title": "printer"}),
        ("get_ticket", {"ticket": "T-9"}),
    ]
    ids = [c.provider_id for c in response.tool_calls]
    assert all(ids) and len(set(ids)) == 2
    assert not any(isinstance(c, MalformedToolCall) for c in response.tool_calls)


# -- exact payloads of a round trip ---------------------------------------------------------

ROUND_TRIP = [
    user("Open a ticket for the printer and look up T-9."),
    assistant(
        "On it.",
        ("create_ticket", {"title": "printer"}, "call_A1"),
        ("get_ticket", {"ticket": "T-9"}, "call_B2"),
    ),
    result("t1-0-0", "create_ticket", value={"id": "T-1"}),
    result("t1-0-1", "get_ticket", "error", text="no ticket T-9"),
]
FAILED = "Error: the tool call failed.\nDetails: no ticket T-9"


async def test_openai_chat_round_trip_payload() -> None:
    """Chat: the assistant's tool_calls, then one tool message per call, ids paired."""
    async with FakeOpenAIChat() as fake:
        adapter = OpenAIChatAdapter("gpt-test", api_key=fake.api_key, base_url=fake.base_url)
        fake.script(Reply(text="Opened T-1; T-9 does not exist."))
        response = await adapter.complete(ask(*ROUND_TRIP, tools=TOOLS[:2]))
    assert response.text == "Opened T-1; T-9 does not exist."
    assert fake.bodies[0] == {
        "model": "gpt-test",
        "messages": [
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": "Open a ticket for the printer and look up T-9."},
            {
                "role": "assistant",
                "content": "On it.",
                "tool_calls": [
                    {
                        "id": "call_A1",
                        "type": "function",
                        "function": {"name": "create_ticket", "arguments": '{"title": "printer"}'},
                    },
                    {
                        "id": "call_B2",
                        "type": "function",
                        "function": {"name": "get_ticket", "arguments": '{"ticket": "T-9"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_A1", "content": '{"id": "T-1"}'},
            {"role": "tool", "tool_call_id": "call_B2", "content": FAILED},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "create_ticket",
                    "description": "Open a ticket.",
                    "parameters": TITLE,
                },
            },
            {
                "type": "function",
                "function": {
                    "name": "get_ticket",
                    "description": "Read one ticket.",
                    "parameters": TICKET,
                },
            },
        ],
    }


async def test_openai_responses_round_trip_payload() -> None:
    """Responses: function_call items, then function_call_output items with the same call_id."""
    async with FakeOpenAIResponses() as fake:
        adapter = OpenAIResponsesAdapter("gpt-test", api_key=fake.api_key, base_url=fake.base_url)
        fake.script(Reply(text="Opened T-1; T-9 does not exist."))
        response = await adapter.complete(ask(*ROUND_TRIP, tools=TOOLS[:1]))
    assert response.text == "Opened T-1; T-9 does not exist."
    assert fake.bodies[0] == {
        "model": "gpt-test",
        "instructions": INSTRUCTIONS,
        "store": False,
        "input": [
            {"role": "user", "content": "Open a ticket for the printer and look up T-9."},
            {"role": "assistant", "content": "On it."},
            {
                "type": "function_call",
                "call_id": "call_A1",
                "name": "create_ticket",
                "arguments": '{"title": "printer"}',
            },
            {
                "type": "function_call",
                "call_id": "call_B2",
                "name": "get_ticket",
                "arguments": '{"ticket": "T-9"}',
            },
            {"type": "function_call_output", "call_id": "call_A1", "output": '{"id": "T-1"}'},
            {"type": "function_call_output", "call_id": "call_B2", "output": FAILED},
        ],
        "tools": [
            {
                "type": "function",
                "name": "create_ticket",
                "description": "Open a ticket.",
                "parameters": TITLE,
                "strict": False,
            },
        ],
    }


async def test_anthropic_round_trip_payload() -> None:
    """Anthropic: tool_use blocks, then tool_result blocks in the next user message; ids that
    another provider made positional are minted again within ^[a-zA-Z0-9_-]+$."""
    history = [
        ROUND_TRIP[0],
        assistant(
            "On it.",
            ("create_ticket", {"title": "printer"}, "functions.create_ticket:0"),
            ("get_ticket", {"ticket": "T-9"}, "functions.get_ticket:1"),
        ),
        *ROUND_TRIP[2:],
        note("T-1 was reconciled by bob."),
    ]
    async with FakeAnthropic() as fake:
        adapter = AnthropicAdapter("claude-test", api_key=fake.api_key, base_url=fake.base_url)
        fake.script(Reply(text="Opened T-1; T-9 does not exist."))
        response = await adapter.complete(ask(*history, tools=TOOLS[:1]))
    assert response.text == "Opened T-1; T-9 does not exist."
    assert fake.received[0].headers["anthropic-version"] == "2023-06-01"
    assert fake.bodies[0] == {
        "model": "claude-test",
        "max_tokens": 4096,
        "system": INSTRUCTIONS,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Open a ticket for the printer and look up T-9."}
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "On it."},
                    {
                        "type": "tool_use",
                        "id": "jl_t1-0-0",
                        "name": "create_ticket",
                        "input": {"title": "printer"},
                    },
                    {
                        "type": "tool_use",
                        "id": "jl_t1-0-1",
                        "name": "get_ticket",
                        "input": {"ticket": "T-9"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "jl_t1-0-0", "content": '{"id": "T-1"}'},
                    {
                        "type": "tool_result",
                        "tool_use_id": "jl_t1-0-1",
                        "content": FAILED,
                        "is_error": True,
                    },
                    {
                        "type": "text",
                        "text": NOTE_PREFIX + "T-1 was reconciled by bob.",
                    },
                ],
            },
        ],
        "tools": [
            {"name": "create_ticket", "description": "Open a ticket.", "input_schema": TITLE}
        ],
    }


# -- pairing and naming ---------------------------------------------------------------------


async def test_positional_and_repeated_ids_are_minted(kit: Kit) -> None:
    """Ids like ``functions.x:0`` repeated every turn are replaced by ids from the engine's
    call ids, unique in the request; a valid unique provider id is kept as it is."""
    long_id = "call_" + "x" * 60
    history = [
        user("open one"),
        assistant("", ("create_ticket", {"title": "a"}, "functions.create_ticket:0")),
        result("t1-0-0", "create_ticket", value={"id": "T-1"}),
        assistant("Opened T-1."),
        user("open another and look it up"),
        assistant(
            "",
            ("create_ticket", {"title": "b"}, "functions.create_ticket:0"),
            ("get_ticket", {"ticket": "T-2"}, "call_kept"),
            ("get_ticket", {"ticket": "T-3"}, "call_kept"),
            ("get_ticket", {"ticket": "T-4"}, long_id),
        ),
        result("t2-0-0", "create_ticket", value={"id": "T-2"}),
        result("t2-0-1", "get_ticket", value={"id": "T-2"}),
        result("t2-0-2", "get_ticket", "error", text="no ticket T-3"),
        result("t2-0-3", "get_ticket", "error", text="no ticket T-4"),
    ]
    kit.fake.script(Reply(text="Done."))
    assert (await kit.adapter.complete(ask(*history))).text == "Done."
    calls, results = wire_calls(kit.kind, kit.fake.bodies[0])
    ids = ["jl_t1-0-0", "jl_t2-0-0", "call_kept", "jl_t2-0-2", "jl_t2-0-3"]
    assert [c[0] for c in calls] == ids
    assert [r[0] for r in results] == ids
    assert [c[2] for c in calls] == [
        {"title": "a"},
        {"title": "b"},
        {"ticket": "T-2"},
        {"ticket": "T-3"},
        {"ticket": "T-4"},
    ]


async def test_results_pair_by_engine_call_index(kit: Kit) -> None:
    """Results stored out of order still answer the right call; an engine id too long for a
    provider id is digested; a call without a result gets one that says so; a note written
    between a call and its results is moved after them."""
    long_turn = "t" + "0" * 50
    history = [
        user("three things"),
        assistant(
            "Working.",
            ("get_ticket", {"ticket": "T-1"}, None),
            ("get_ticket", {"ticket": "T-2"}, None),
            ("create_ticket", {"title": "x"}, None),
        ),
        note("a reconcile landed here"),
        result(f"{long_turn}-0-1", "get_ticket", value="second"),
        result(f"{long_turn}-0-0", "get_ticket", value="first"),
    ]
    kit.fake.script(Reply(text="ok"))
    await kit.adapter.complete(ask(*history))
    body = kit.fake.bodies[0]
    calls, results = wire_calls(kit.kind, body)
    assert [c[2] for c in calls] == [{"ticket": "T-1"}, {"ticket": "T-2"}, {"title": "x"}]
    first, second, third = (c[0] for c in calls)
    assert first.startswith("jl_") and len(first) <= 40 and first != second
    assert third == "jl_m1_c2"
    assert [(r[0], r[1]) for r in results] == [
        (first, "first"),
        (second, "second"),
        (third, NO_RESULT),
    ]
    if kit.kind == "anthropic":
        assert [r[2] for r in results] == [False, False, True]
    assert texts(kit.kind, body)[-1].endswith("a reconcile landed here")


@pytest.mark.parametrize("status", ["error", "outcome_unknown", "denied", "cancelled"])
async def test_statuses_are_told_to_the_model(kit: Kit, status: str) -> None:
    """Every non-ok status reaches the model as words it understands (is_error for Anthropic)."""
    history = [
        user("close T-1"),
        assistant("", ("close_ticket", {"ticket": "T-1"}, "call_c1")),
        result("t1-0-0", "close_ticket", status, text="because"),
    ]
    kit.fake.script(Reply(text="ok"))
    await kit.adapter.complete(ask(*history))
    _, results = wire_calls(kit.kind, kit.fake.bodies[0])
    assert results[0][1] == f"{STATUS_TEXT[status]}\nDetails: because"
    if kit.kind == "anthropic":
        assert results[0][2] is True


async def test_summary_request_writes_calls_as_text(kit: Kit) -> None:
    """The summary call has no tools, so calls and results go as text, and the request ends
    with the user asking for the summary (never on an assistant message to be continued)."""
    history = [*ROUND_TRIP, assistant("Opened T-1.")]
    kit.fake.script(Reply(text="The user opened T-1."))
    response = await kit.adapter.complete(ask(*history, tools=[], purpose="summary"))
    assert response.text == "The user opened T-1."
    body = kit.fake.bodies[0]
    assert wire_calls(kit.kind, body) == ([], [])
    sent = texts(kit.kind, body)
    assert sent[-1] == SUMMARY_REQUEST
    assert any('[called create_ticket with {"title": "printer"}]' in t for t in sent)
    assert any(FAILED in t for t in sent)


# -- errors ----------------------------------------------------------------------------------


async def test_rate_limit_is_retryable_with_retry_after(kit: Kit) -> None:
    """429 with Retry-After → ProviderRetryable carrying the delay; the next attempt succeeds."""
    kit.fake.script(
        Failure(429, "Rate limit reached for requests", "rate_limit_error", {"retry-after": "7"}),
        Reply(text="fine now"),
    )
    with pytest.raises(ProviderRetryable) as caught:
        await kit.adapter.complete(ask(user("hi")))
    err = caught.value
    assert (err.status, err.retry_after, err.request_id) == (429, 7.0, "req_fake")
    assert "Rate limit reached for requests" in str(err)
    assert (await kit.adapter.complete(ask(user("hi")))).text == "fine now"


async def test_server_errors_are_retryable(kit: Kit) -> None:
    """500 and Anthropic's 529 (overloaded) → ProviderRetryable without a delay."""
    kit.fake.script(
        Failure(500, "The server had an error", "server_error"),
        Failure(529, "Overloaded", "overloaded_error"),
    )
    for status in (500, 529):
        with pytest.raises(ProviderRetryable) as caught:
            await kit.adapter.complete(ask(user("hi")))
        assert (caught.value.status, caught.value.retry_after) == (status, None)


async def test_bad_request_is_rejected_with_the_provider_message(kit: Kit) -> None:
    """400 → ProviderRejected with the provider's message and error type; so is a 429 that
    says the account is out of quota (retrying cannot help)."""
    kit.fake.script(
        Failure(400, "max_tokens: 999999 > 8192, the maximum", "invalid_request_error"),
        Failure(429, "You exceeded your current quota", "insufficient_quota"),
    )
    with pytest.raises(ProviderRejected) as caught:
        await kit.adapter.complete(ask(user("hi")))
    assert caught.value.status == 400
    assert caught.value.message == "max_tokens: 999999 > 8192, the maximum"
    assert caught.value.error_type == "invalid_request_error"
    with pytest.raises(ProviderRejected, match="current quota"):
        await kit.adapter.complete(ask(user("hi")))


async def test_unreadable_answers_and_provider_hints() -> None:
    """A 200 body unlike the documented shape is retryable (a provider fault); so is a failed
    Responses object; ``x-should-retry`` overrides the status's usual class."""
    async with FakeOpenAIChat() as chat, FakeOpenAIResponses() as responses:
        chat.script(
            Raw({"object": "chat.completion", "choices": []}),
            Raw({"error": {"message": "try me later"}}, 400, {"x-should-retry": "true"}),
            Raw({"error": {"message": "never again"}}, 503, {"x-should-retry": "false"}),
        )
        adapter = OpenAIChatAdapter("m", api_key=chat.api_key, base_url=chat.base_url)
        with pytest.raises(ProviderRetryable, match="could not be read"):
            await adapter.complete(ask(user("x")))
        with pytest.raises(ProviderRetryable, match="try me later"):
            await adapter.complete(ask(user("x")))
        with pytest.raises(ProviderRejected, match="never again"):
            await adapter.complete(ask(user("x")))
        failed = {"status": "failed", "error": {"code": "server_error", "message": "boom"}}
        responses.script(Raw({"object": "response", **failed}))
        other = OpenAIResponsesAdapter("m", api_key=responses.api_key, base_url=responses.base_url)
        with pytest.raises(ProviderRetryable, match="boom"):
            await other.complete(ask(user("x")))


async def test_timeout_is_retryable(kit: Kit) -> None:
    """A provider that never answers → ProviderRetryable when the adapter's timeout passes."""
    kit.fake.script(Stall())
    quick = ADAPTERS[kit.kind](
        "m", api_key=kit.fake.api_key, base_url=kit.fake.base_url, timeout=0.2
    )
    with pytest.raises(ProviderRetryable, match="timed out"):
        await quick.complete(ask(user("hi")))


async def test_refused_connection_is_retryable() -> None:
    """Nothing listening → ProviderRetryable (the engine tries again later)."""
    async with FakeOpenAIChat() as fake:
        url = fake.base_url
    adapter = OpenAIChatAdapter("m", api_key="sk-x", base_url=url)
    with pytest.raises(ProviderRetryable, match="connection failed"):
        await adapter.complete(ask(user("hi")))


MALFORMED = [(k, s) for k in KINDS for s in (False, True) if (k, s) != ("anthropic", False)]


@pytest.mark.parametrize(("kind", "stream"), MALFORMED)
async def test_malformed_arguments_do_not_raise(kind: str, stream: bool) -> None:
    """Broken JSON or a non-object as arguments → a MalformedToolCall with ``{}``, the raw
    text and the problem, next to the well-formed calls; "" means no arguments.
    (Anthropic sends parsed objects unless streaming, so only its stream can break.)"""
    async with FAKES[kind]() as fake:
        adapter = ADAPTERS[kind]("m", api_key=fake.api_key, base_url=fake.base_url)
        fake.script(
            Reply(
                calls=(
                    FakeCall("create_ticket", raw='{"title": "printer'),
                    FakeCall("get_ticket", raw="[1, 2]"),
                    FakeCall("list_tickets", raw=""),
                    FakeCall("get_ticket", {"ticket": "T-1"}),
                )
            )
        )
        response = await adapter.complete(ask(user("x")), on_delta=_ignore if stream else None)
    broken, not_object, empty, fine = response.tool_calls
    assert isinstance(broken, MalformedToolCall) and isinstance(not_object, MalformedToolCall)
    assert (broken.name, broken.arguments, broken.raw_arguments) == (
        "create_ticket",
        {},
        '{"title": "printer',
    )
    assert "not valid JSON" in broken.problem and broken.provider_id
    assert "not an object" in not_object.problem
    assert not isinstance(empty, MalformedToolCall) and empty.arguments == {}
    assert not isinstance(fine, MalformedToolCall) and fine.arguments == {"ticket": "T-1"}


async def _ignore(delta: str) -> None:
    return None


# -- streaming -------------------------------------------------------------------------------


async def test_streaming_hands_over_deltas_and_assembles_calls(kit: Kit) -> None:
    """With on_delta the adapter streams: text arrives in pieces, calls are assembled from
    fragments, and the final response equals the non-streamed one."""
    reply = Reply(
        text="Opening two tickets now.",
        calls=(
            FakeCall("create_ticket", {"title": "printer on fire"}),
            FakeCall("create_ticket", {"title": "toner"}),
        ),
        usage=(40, 12),
    )
    kit.fake.script(reply, reply)
    deltas: list[str] = []

    async def on_delta(text: str) -> None:
        deltas.append(text)

    streamed = await kit.adapter.complete(ask(user("x")), on_delta=on_delta)
    plain = await kit.adapter.complete(ask(user("x")))
    assert len(deltas) > 1 and "".join(deltas) == "Opening two tickets now."
    assert kit.fake.bodies[0]["stream"] is True
    strip = [replace(c, provider_id=None) for c in streamed.tool_calls]
    assert strip == [replace(c, provider_id=None) for c in plain.tool_calls]
    assert [c.arguments["title"] for c in streamed.tool_calls] == ["printer on fire", "toner"]
    assert all(c.provider_id for c in streamed.tool_calls)
    assert streamed.text == plain.text
    assert streamed.usage == plain.usage == {"input_tokens": 40, "output_tokens": 12}


@pytest.mark.parametrize(
    ("error_type", "expected"),
    [("overloaded_error", ProviderRetryable), ("invalid_request_error", ProviderRejected)],
)
async def test_error_inside_a_stream(kit: Kit, error_type: str, expected: type[Exception]) -> None:
    """An error event after a 200 raises like an HTTP error of its kind would."""
    kit.fake.script(Reply(text="partial", stream_error=(error_type, "it broke")))
    with pytest.raises(expected, match="it broke"):
        await kit.adapter.complete(ask(user("x")), on_delta=_ignore)


async def test_cut_stream_is_retryable(kit: Kit) -> None:
    """A stream that stops before the provider's closing event → ProviderRetryable."""
    kit.fake.script(Reply(text="half an answer", cut=True))
    with pytest.raises(ProviderRetryable, match="stream ended"):
        await kit.adapter.complete(ask(user("x")), on_delta=_ignore)


async def test_delta_handler_failure_is_not_a_provider_error(kit: Kit) -> None:
    """The engine's own hook failing propagates as it is, not disguised as an outage."""
    kit.fake.script(Reply(text="some text"))

    async def broken(text: str) -> None:
        raise TimeoutError("the event bus is slow")

    with pytest.raises(TimeoutError, match="event bus"):
        await kit.adapter.complete(ask(user("x")), on_delta=broken)


async def test_sse_parser_survives_any_split() -> None:
    """Events split at every byte, CRLF endings, comments and multi-line data still parse;
    an event cut off by the end of the stream is not dispatched (as the SSE spec says)."""
    raw = b': hello\r\nevent: a\r\ndata: {"x":\r\ndata: 1}\r\n\r\ndata: [DONE]\n\ndata: tail'

    async def bytewise() -> AsyncIterator[bytes]:
        for i in range(len(raw)):
            yield raw[i : i + 1]

    events = [(e.event, e.data) for e in [e async for e in sse_events(bytewise())]]
    assert events == [("a", '{"x":\n1}'), (None, "[DONE]")]


# -- keys, usage, sessions -------------------------------------------------------------------


async def test_api_key_is_sent_in_the_right_header_and_never_shown(kit: Kit) -> None:
    """The key goes in the provider's header and nowhere else: not in repr/str of the
    adapter, nor in errors (even when the provider echoes it back), nor in logs."""
    kit.fake.script(Reply(text="hi"))
    await kit.adapter.complete(ask(user("hi")))
    headers = kit.fake.received[0].headers
    key = kit.fake.api_key
    if kit.kind == "anthropic":
        assert headers["x-api-key"] == key and "authorization" not in headers
    else:
        assert headers["authorization"] == f"Bearer {key}" and "x-api-key" not in headers
    assert key not in repr(kit.adapter) and key not in str(kit.adapter)
    assert key not in repr(vars(kit.adapter))

    wrong_key = "sk-wrong-SECRET-42"
    wrong = ADAPTERS[kit.kind]("m", api_key=wrong_key, base_url=kit.fake.base_url)
    with capture_logs() as logs, pytest.raises(ProviderRejected) as caught:
        await wrong.complete(ask(user("hi")))
    assert caught.value.status == 401
    shown = [str(caught.value), repr(caught.value), repr(caught.value.args), repr(logs)]
    assert not [s for s in shown if wrong_key in s]
    assert logs and logs[0]["event"] == "model.provider_error"


async def test_estimate_tokens_counts_what_the_provider_would_receive(kit: Kit) -> None:
    """About four characters a token of the rendered messages; more history, more tokens."""
    short = [user("hi")]
    long = [*ROUND_TRIP, user("x" * 4000)]
    small, big = kit.adapter.estimate_tokens(short), kit.adapter.estimate_tokens(long)
    assert 0 < small < 50
    assert 1000 <= big - small <= 1300


async def test_sessions_are_owned_or_borrowed() -> None:
    """Outside ``async with`` each call opens and closes its own session; inside, one pool is
    kept and closed at the end (idempotently); a session passed in is never closed."""
    async with FakeOpenAIChat() as fake:
        fake.script(Reply(text="a"), Reply(text="b"), Reply(text="c"))
        loose = OpenAIChatAdapter("m", api_key=fake.api_key, base_url=fake.base_url)
        assert (await loose.complete(ask(user("x")))).text == "a"
        async with OpenAIChatAdapter("m", api_key=fake.api_key, base_url=fake.base_url) as owned:
            assert (await owned.complete(ask(user("x")))).text == "b"
        await owned.aclose()
        async with aiohttp.ClientSession() as session:
            borrowed = OpenAIChatAdapter(
                "m", api_key=fake.api_key, base_url=fake.base_url, session=session
            )
            async with borrowed:
                assert (await borrowed.complete(ask(user("x")))).text == "c"
            assert not session.closed


def test_retry_after_forms() -> None:
    """Seconds, milliseconds (OpenAI's retry-after-ms) and HTTP dates; junk gives None."""
    assert retry_after({"retry-after": "7"}) == 7.0
    assert retry_after({"retry-after": "1.5", "retry-after-ms": "250"}) == 0.25
    assert retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:30 GMT"}, now=1445412480.0) == 30.0
    assert retry_after({"retry-after": "-3"}) == 0.0
    assert retry_after({"retry-after": "soon"}) is None
    assert retry_after({}) is None


# -- the factory -----------------------------------------------------------------------------


def test_adapter_from_spec() -> None:
    """Each spec names its adapter; a model may contain "@"; the key never shows in repr."""
    chat = adapter_from_spec("openai:gpt-4o-mini", api_key="sk-a")
    assert type(chat) is OpenAIChatAdapter and chat.model == "gpt-4o-mini"
    model: ModelAdapter = chat  # the engine's seam, checked by mypy
    assert Agent(name="support", instructions="…", model=model).model is chat
    assert chat.base_url == "https://api.openai.com/v1"
    responses = adapter_from_spec("openai-responses:gpt-4.1", api_key="sk-a", max_tokens=100)
    assert type(responses) is OpenAIResponsesAdapter and responses.max_tokens == 100
    claude = adapter_from_spec("anthropic:claude-sonnet-4-5", api_key="sk-ant-b")
    assert type(claude) is AnthropicAdapter and claude.base_url == "https://api.anthropic.com"
    assert "sk-ant-b" not in repr(claude)
    local = adapter_from_spec("openai-compatible:org/model@v2@http://127.0.0.1:11434/v1")
    assert type(local) is OpenAIChatAdapter
    assert (local.model, local.base_url) == ("org/model@v2", "http://127.0.0.1:11434/v1")


@pytest.mark.parametrize(
    ("spec", "key", "message"),
    [
        ("gpt-4o", "sk", "expected one of"),
        ("openai:", "sk", "expected one of"),
        ("mistral:large", "sk", "expected one of"),
        ("openai:gpt-4o", None, "needs an API key"),
        ("anthropic:claude", " ", "needs an API key"),
        ("openai-compatible:llama", None, "needs a base URL"),
    ],
)
def test_adapter_from_spec_errors(spec: str, key: str | None, message: str) -> None:
    """A wrong spec fails at once and says what is expected."""
    with pytest.raises(ValueError, match=message):
        adapter_from_spec(spec, api_key=key)


# -- one conversation, three providers -------------------------------------------------------


def run_tool(call: ToolCallRequest, call_id: str) -> Message:
    """The engine's side: a tool result as ``jetloop.consumers.followers.joined`` records it."""
    if call.name == "close_ticket":
        return result(call_id, call.name, "denied", text="rejected by alice: not yet")
    if call.name == "get_ticket" and call.arguments["ticket"] == "T-9":
        return result(call_id, call.name, "error", text="no ticket T-9")
    return result(call_id, call.name, value={"ticket": "T-1", **call.arguments})


def script(fake: FakeProvider) -> None:
    fake.script(
        Reply(
            text="On it.",
            calls=(
                FakeCall("create_ticket", {"title": "printer"}),
                FakeCall("get_ticket", {"ticket": "T-9"}),
            ),
        ),
        Reply(text="Opened T-1; there is no T-9."),
        Reply(calls=(FakeCall("close_ticket", {"ticket": "T-1"}),)),
        Reply(text="Closing T-1 was not approved."),
    )


async def converse(adapter: HttpAdapter, stream: bool) -> list[Message]:
    """Two turns driven like the engine does: answer, run the calls, answer again."""
    history: list[Message] = []
    for turn, text in enumerate(["open a ticket and look up T-9", "close T-1"], start=1):
        history.append(user(text))
        for step in range(4):
            r = await adapter.complete(ask(*history), on_delta=_ignore if stream else None)
            history.append(Message(role="assistant", text=r.text, calls=r.tool_calls))
            if not r.tool_calls:
                break
            history += [run_tool(c, f"t{turn}-{step}-{i}") for i, c in enumerate(r.tool_calls)]
    return history


def comparable(history: Iterable[Message]) -> list[Message]:
    """A history without the provider's ids, which differ by design."""
    return [replace(m, calls=[replace(c, provider_id=None) for c in m.calls]) for m in history]


@pytest.mark.parametrize("stream", [False, True])
async def test_same_conversation_same_history_on_every_provider(stream: bool) -> None:
    """The same scripted conversation through each provider's fake yields the same jetloop
    history: tool names, arguments, results and text."""
    histories = []
    for kind in KINDS:
        async with FAKES[kind]() as fake:
            script(fake)
            adapter = ADAPTERS[kind]("m", api_key=fake.api_key, base_url=fake.base_url)
            async with adapter:
                histories.append(comparable(await converse(adapter, stream)))
            assert len(fake.received) == 4
    assert histories[0] == histories[1] == histories[2]
    assert [m.role for m in histories[0]] == [
        "user", "assistant", "tool", "tool", "assistant", "user", "assistant", "tool", "assistant",
    ]  # fmt: skip
    assert histories[0][-1].text == "Closing T-1 was not approved."
