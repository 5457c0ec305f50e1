"""A fake Anthropic Messages server: ``POST /v1/messages``, ``x-api-key`` and ``anthropic-version``.

Checks what Anthropic checks (the version header, ``max_tokens``, no ``system`` role, tool_use
ids matching ``^[a-zA-Z0-9_-]+$`` and unique, every ``tool_use`` answered by a ``tool_result``
leading the very next user message and no result without its ``tool_use``, non-empty text
blocks, tools defined whenever tool blocks appear) with Anthropic's error wording; answers with
``message`` objects or the event stream (``message_start``, ``content_block_start``,
``content_block_delta`` with ``text_delta`` / ``input_json_delta``, ``message_delta``,
``message_stop``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from aiohttp import web

from tests.fakes.base import FakeProvider, Reply, pieces

TOOL_USE_ID = re.compile(r"^[a-zA-Z0-9_-]+$")


class FakeAnthropic(FakeProvider):
    path = "/v1/messages"
    base_path = ""

    def authorized(self, request: web.Request) -> bool:
        return request.headers.get("x-api-key") == self.api_key

    def unauthorized_message(self, request: web.Request) -> str:
        return "invalid x-api-key"

    def error_body(self, status: int, message: str, error_type: str) -> dict[str, Any]:
        return {"type": "error", "error": {"type": error_type, "message": message}}

    def validate(self, request: web.Request, body: dict[str, Any]) -> str | None:
        if not request.headers.get("anthropic-version"):
            return "anthropic-version: header is required"
        if not isinstance(body.get("max_tokens"), int):
            return "max_tokens: Field required"
        messages = body.get("messages")
        if not messages:
            return "messages: at least one message is required"
        seen: set[str] = set()
        open_uses: list[str] = []
        tool_blocks = False
        for i, m in enumerate(messages):
            role = m.get("role")
            if role not in ("user", "assistant"):
                return (
                    f'messages.{i}.role: Input should be "user" or "assistant". The Messages '
                    "API accepts a top-level `system` parameter, not a system message."
                )
            content = m.get("content")
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            for k, b in enumerate(blocks):
                if b.get("type") == "text" and not b.get("text"):
                    return f"messages.{i}.content.{k}.text: text content blocks must be non-empty"
            if role == "user":
                results = [b for b in blocks if b.get("type") == "tool_result"]
                tool_blocks = tool_blocks or bool(results)
                lead = len(results)
                if any(b.get("type") != "tool_result" for b in blocks[:lead]):
                    return (
                        f"messages.{i}: `tool_result` blocks must come first in the content, "
                        "before any other block"
                    )
                ids = [b.get("tool_use_id") for b in results]
                for k, rid in enumerate(ids):
                    if rid not in open_uses:
                        return (
                            f"messages.{i}.content.{k}: unexpected `tool_use_id` found in "
                            f"`tool_result` blocks: {rid}. Each `tool_result` block must have a "
                            "corresponding `tool_use` block in the previous message."
                        )
                missing = [u for u in open_uses if u not in ids]
                if missing:
                    return _unanswered(i, missing)
                open_uses = []
            else:
                if open_uses:
                    return _unanswered(i, open_uses)
                for k, b in enumerate(blocks):
                    if b.get("type") != "tool_use":
                        continue
                    tool_blocks = True
                    uid = b.get("id") or ""
                    if not TOOL_USE_ID.match(uid):
                        return (
                            f"messages.{i}.content.{k}.tool_use.id: String should match "
                            "pattern '^[a-zA-Z0-9_-]+$'"
                        )
                    if uid in seen:
                        return f"messages.{i}.content.{k}: `tool_use` ids must be unique"
                    if not isinstance(b.get("input"), dict):
                        return f"messages.{i}.content.{k}.tool_use.input: Input should be an object"
                    seen.add(uid)
                    open_uses.append(uid)
        if open_uses:
            return _unanswered(len(messages), open_uses)
        if tool_blocks and not body.get("tools"):
            return "Requests which include `tool_use` or `tool_result` blocks must define tools."
        return None

    def _content(self, reply: Reply) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if reply.text:
            out.append({"type": "text", "text": reply.text})
        for c in reply.calls:
            out.append(
                {"type": "tool_use", "id": self.new_id("toolu_01"), "name": c.name, "input": {}}
            )
        return out

    def render(self, reply: Reply, body: dict[str, Any]) -> dict[str, Any]:
        content = self._content(reply)
        for block, call in zip(
            [b for b in content if b["type"] == "tool_use"], reply.calls, strict=True
        ):
            block["input"] = call.arguments  # the API only ever sends an object here
        prompt, completion = reply.usage
        return {
            "id": self.new_id("msg_01"),
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": content,
            "stop_reason": "tool_use" if reply.calls else "end_turn",
            "stop_sequence": None,
            "usage": {
                "input_tokens": prompt,
                "output_tokens": completion,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }

    def events(self, reply: Reply, body: dict[str, Any]) -> Iterable[tuple[str | None, Any]]:
        def event(kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
            return kind, {"type": kind, **data}

        completion = reply.usage[1]
        start = self.render(Reply(usage=reply.usage), body)
        start["usage"]["output_tokens"] = 1
        start["stop_reason"] = None
        yield event("message_start", message=start)
        yield event("ping")
        calls = iter(reply.calls)
        for index, block in enumerate(self._content(reply)):
            if block["type"] == "text":
                yield event("content_block_start", index=index, content_block={**block, "text": ""})
                for piece in pieces(block["text"]):
                    yield event(
                        "content_block_delta",
                        index=index,
                        delta={"type": "text_delta", "text": piece},
                    )
            else:
                call = next(calls)
                yield event("content_block_start", index=index, content_block=block)
                # The real stream opens every tool input with an empty fragment.
                for piece in ["", *pieces(call.arguments_json(), 5)]:
                    yield event(
                        "content_block_delta",
                        index=index,
                        delta={"type": "input_json_delta", "partial_json": piece},
                    )
            yield event("content_block_stop", index=index)
        if reply.stream_error is not None:
            kind, message = reply.stream_error
            yield event("error", error={"type": kind, "message": message})
            return
        if reply.cut:
            return
        yield event(
            "message_delta",
            delta={"stop_reason": "tool_use" if reply.calls else "end_turn", "stop_sequence": None},
            usage={"output_tokens": completion},
        )
        yield event("message_stop")


def _unanswered(index: int, ids: list[str]) -> str:
    return (
        f"messages.{index}: `tool_use` ids were found without `tool_result` blocks immediately "
        f"after: {', '.join(ids)}. Each `tool_use` block must have a corresponding `tool_result` "
        "block in the next message."
    )
