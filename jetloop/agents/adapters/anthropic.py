"""Anthropic Messages (``POST {base_url}/v1/messages``, ``x-api-key``, ``anthropic-version``).

Mapping of the jetloop history:

- instructions → the top-level ``system`` field (the only place for a system prompt);
- user text, notes and the summary → ``user`` text blocks (notes and the summary say that they
  come from the system, not the user);
- an assistant message → an ``assistant`` message with a text block and ``tool_use`` blocks;
- its results → ``tool_result`` blocks (``tool_use_id``, string content, ``is_error`` for every
  status but ok) leading the very next ``user`` message, as the API requires.

Consecutive messages of one role are merged into one message, text after the tool results;
empty text blocks are left out because the API rejects them. ``max_tokens`` is required by
the API, so it defaults to 4096.

Streaming assembles ``content_block_start`` / ``content_block_delta`` (``text_delta``,
``input_json_delta``) / ``message_delta`` / ``message_stop``; an ``error`` event (such as
``overloaded_error``) raises.
"""

from __future__ import annotations

import json
from typing import Any

from jetloop.agents.adapters.base import HttpAdapter, SseEvent, StreamAssembler, tool_call, usage
from jetloop.agents.adapters.history import Context, Item, UserText
from jetloop.agents.model import ModelRequest, ModelResponse, ToolCallRequest

API_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096


class AnthropicAdapter(HttpAdapter):
    """Anthropic's Messages API."""

    provider = "anthropic"
    default_base_url = "https://api.anthropic.com"
    path = "/v1/messages"

    def headers(self) -> dict[str, str]:
        out = {"anthropic-version": API_VERSION}
        if self._key:
            out["x-api-key"] = self._key.reveal()
        return out

    def render(self, request: ModelRequest, items: list[Item]) -> dict[str, Any]:
        messages: list[dict[str, Any]] = []

        def add(role: str, blocks: list[dict[str, Any]]) -> None:
            if not blocks:
                return
            if messages and messages[-1]["role"] == role:
                messages[-1]["content"] += blocks
            else:
                messages.append({"role": role, "content": blocks})

        for item in items:
            if isinstance(item, UserText | Context):
                add("user", [_text(item.text or "(empty message)")])
            else:
                add(
                    "assistant",
                    ([_text(item.text)] if item.text else [])
                    + [
                        {"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments}
                        for c in item.calls
                    ],
                )
                add(
                    "user",
                    [
                        {
                            "type": "tool_result",
                            "tool_use_id": r.call_id,
                            "content": r.content,
                            **({"is_error": True} if r.is_error else {}),
                        }
                        for r in item.results
                    ],
                )
        if messages and messages[0]["role"] != "user":
            # The API wants the conversation to open with the user.
            messages.insert(0, {"role": "user", "content": [_text("(conversation resumed)")]})
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens or DEFAULT_MAX_TOKENS,
            "messages": messages,
        }
        if request.instructions:
            body["system"] = request.instructions
        if request.tools:
            body["tools"] = [
                {"name": t.name, "description": t.description, "input_schema": t.parameters}
                for t in request.tools
            ]
        return body

    def parse(self, body: Any) -> ModelResponse:
        text: list[str] = []
        calls: list[ToolCallRequest] = []
        for block in body.get("content") or []:
            if block.get("type") == "text":
                text.append(block.get("text", ""))
            elif block.get("type") == "tool_use":
                calls.append(tool_call(block["name"], block.get("input"), block.get("id")))
        return ModelResponse(text="".join(text), tool_calls=calls, usage=_usage(body.get("usage")))

    def assembler(self) -> StreamAssembler:
        return _MessagesStream(self)


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _usage(raw: Any) -> dict[str, int]:
    if not raw:
        return {}
    # Anthropic counts cache reads and writes apart from input_tokens; jetloop's input_tokens
    # is every prompt token, as OpenAI counts it.
    read = raw.get("cache_read_input_tokens") or 0
    written = raw.get("cache_creation_input_tokens") or 0
    return usage((raw.get("input_tokens") or 0) + read + written, raw.get("output_tokens"), read)


class _MessagesStream(StreamAssembler):
    def __init__(self, adapter: AnthropicAdapter) -> None:
        self.adapter = adapter
        self.blocks: dict[int, dict[str, Any]] = {}
        self.partial_json: dict[int, list[str]] = {}
        self.raw_usage: dict[str, Any] = {}

    def feed(self, event: SseEvent) -> str | None:
        data = json.loads(event.data)
        kind = data.get("type") or event.event
        if kind == "message_start":
            self.raw_usage.update(data["message"].get("usage") or {})
        elif kind == "content_block_start":
            self.blocks[data["index"]] = dict(data["content_block"])
        elif kind == "content_block_delta":
            block = self.blocks.setdefault(data["index"], {"type": "text", "text": ""})
            delta = data["delta"]
            if delta.get("type") == "text_delta":
                block["text"] = block.get("text", "") + delta["text"]
                return str(delta["text"]) or None
            if delta.get("type") == "input_json_delta":
                self.partial_json.setdefault(data["index"], []).append(delta["partial_json"])
        elif kind == "message_delta":
            # message_delta's usage is cumulative: it replaces, never adds.
            self.raw_usage.update({k: v for k, v in (data.get("usage") or {}).items() if v})
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            raise self.adapter.stream_error(data.get("error"))
        return None

    def response(self) -> ModelResponse:
        text: list[str] = []
        calls: list[ToolCallRequest] = []
        for index, block in sorted(self.blocks.items()):
            if block.get("type") == "text":
                text.append(block.get("text", ""))
            elif block.get("type") == "tool_use":
                pieces = self.partial_json.get(index)
                raw: Any = "".join(pieces) if pieces else block.get("input")
                calls.append(tool_call(block["name"], raw, block.get("id")))
        return ModelResponse(text="".join(text), tool_calls=calls, usage=_usage(self.raw_usage))
