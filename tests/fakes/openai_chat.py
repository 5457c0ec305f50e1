"""A fake OpenAI Chat Completions server: ``POST /v1/chat/completions``, bearer auth.

Checks what OpenAI checks about tool calls (every ``tool_calls`` id answered by ``tool``
messages right after it, ids of at most 40 characters, arguments as strings) with OpenAI's
error wording; answers with ``chat.completion`` objects or ``chat.completion.chunk`` streams
(tool calls in ``delta.tool_calls`` fragments, usage in a last chunk, then ``[DONE]``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aiohttp import web

from tests.fakes.base import FakeCall, FakeProvider, Reply, pieces

ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class FakeOpenAIChat(FakeProvider):
    path = "/v1/chat/completions"
    base_path = "/v1"

    def authorized(self, request: web.Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {self.api_key}"

    def unauthorized_message(self, request: web.Request) -> str:
        given = request.headers.get("authorization", "").removeprefix("Bearer ")
        return f"Incorrect API key provided: {given}. You can find your API key at …"

    def error_body(self, status: int, message: str, error_type: str) -> dict[str, Any]:
        code = "invalid_api_key" if status == 401 else None
        return {"error": {"message": message, "type": error_type, "param": None, "code": code}}

    def validate(self, request: web.Request, body: dict[str, Any]) -> str | None:
        if not isinstance(body.get("model"), str):
            return "you must provide a model parameter"
        messages = body.get("messages")
        if not messages:
            return (
                "Invalid 'messages': empty array. Expected an array with minimum length 1, "
                "but got an empty array instead."
            )
        tools = body.get("tools")
        if tools is not None:
            if not tools:
                return "Invalid 'tools': empty array. Expected an array with minimum length 1."
            for i, t in enumerate(tools):
                if t.get("type") != "function" or "name" not in (t.get("function") or {}):
                    return f"Missing required parameter: 'tools[{i}].function'."
        if "stream_options" in body and not body.get("stream"):
            return "The 'stream_options' parameter is only allowed when 'stream' is enabled."
        pending: list[str] = []
        for i, m in enumerate(messages):
            role = m.get("role")
            if role not in ROLES:
                return f"Invalid value: '{role}'. Supported values are: {', '.join(ROLES)}."
            if role == "tool":
                if m.get("tool_call_id") not in pending:
                    return (
                        "Invalid parameter: messages with role 'tool' must be a response to a "
                        "preceeding message with 'tool_calls'."
                    )
                pending.remove(m["tool_call_id"])
                if not isinstance(m.get("content"), str | list):
                    return f"Invalid type for 'messages[{i}].content': expected a string."
                continue
            if pending:
                return _unanswered(pending)
            if role == "assistant":
                if m.get("content") is None and not m.get("tool_calls"):
                    return f"Invalid value for 'messages[{i}].content': expected a string."
                for k, c in enumerate(m.get("tool_calls") or []):
                    cid = c.get("id") or ""
                    if len(cid) > 40:
                        return (
                            f"Invalid 'messages[{i}].tool_calls[{k}].id': string too long. "
                            "Expected a string with maximum length 40, but got a string with "
                            f"length {len(cid)} instead."
                        )
                    if not isinstance((c.get("function") or {}).get("arguments"), str):
                        return (
                            f"Invalid type for 'messages[{i}].tool_calls[{k}].function."
                            "arguments': expected a string, but got an object instead."
                        )
                    pending.append(cid)
            elif not isinstance(m.get("content"), str | list):
                return f"Invalid type for 'messages[{i}].content': expected a string."
        return _unanswered(pending) if pending else None

    def _call_id(self, index: int, call: FakeCall) -> str:
        if self.id_style == "positional":
            return f"functions.{call.name}:{index}"
        return self.new_id("call_")

    def render(self, reply: Reply, body: dict[str, Any]) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": reply.text or None,
            "refusal": None,
        }
        if reply.calls:
            message["tool_calls"] = [
                {
                    "id": self._call_id(k, c),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments_json()},
                }
                for k, c in enumerate(reply.calls)
            ]
        return {
            "id": self.new_id("chatcmpl-"),
            "object": "chat.completion",
            "created": 1_700_000_000,
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": "tool_calls" if reply.calls else "stop",
                }
            ],
            "usage": _usage(reply),
        }

    def events(self, reply: Reply, body: dict[str, Any]) -> Iterable[tuple[str | None, Any]]:
        cid = self.new_id("chatcmpl-")

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": 1_700_000_000,
                "model": body["model"],
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }

        yield None, chunk({"role": "assistant", "content": "", "refusal": None})
        for piece in pieces(reply.text):
            yield None, chunk({"content": piece})
        for k, c in enumerate(reply.calls):
            head = {
                "index": k,
                "id": self._call_id(k, c),
                "type": "function",
                "function": {"name": c.name, "arguments": ""},
            }
            yield None, chunk({"tool_calls": [head]})
            for piece in pieces(c.arguments_json(), 5):
                yield None, chunk({"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
        if reply.stream_error is not None:
            kind, message = reply.stream_error
            yield None, {"error": {"message": message, "type": kind, "param": None, "code": None}}
            return
        if reply.cut:
            return
        yield None, chunk({}, "tool_calls" if reply.calls else "stop")
        if (body.get("stream_options") or {}).get("include_usage"):
            last = chunk({})
            last["choices"] = []
            last["usage"] = _usage(reply)
            yield None, last
        yield None, "[DONE]"


def _unanswered(pending: list[str]) -> str:
    return (
        "An assistant message with 'tool_calls' must be followed by tool messages responding "
        "to each 'tool_call_id'. The following tool_call_ids did not have response messages: "
        + ", ".join(pending)
    )


def _usage(reply: Reply) -> dict[str, Any]:
    prompt, completion = reply.usage
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
