"""OpenAI Responses (``POST {base_url}/responses``), stateless: the whole history every time.

Mapping of the jetloop history:

- instructions → the ``instructions`` field; notes and the summary → ``developer`` messages;
- user text → ``user`` messages; assistant text → ``assistant`` messages;
- each call → a ``function_call`` item (``call_id``, ``name``, JSON string ``arguments``),
  each result → a ``function_call_output`` item with the same ``call_id``, after the calls.

``store`` is false and no item ``id`` (``fc_…``) is sent back: an item id makes the API look
for the stored reasoning item that produced it, which a stateless request does not carry.

Streaming reads ``response.output_item.added`` / ``…done`` for the items,
``response.output_text.delta`` for the text and ``response.function_call_arguments.delta`` for
arguments still being written, and ``response.completed`` for the usage; the assembled output
goes through the same parser as a non-streamed response.
"""

from __future__ import annotations

import json
from typing import Any

from jetloop.agents.adapters.base import HttpAdapter, SseEvent, StreamAssembler, tool_call, usage
from jetloop.agents.adapters.history import Context, Item, UserText
from jetloop.agents.model import ModelRequest, ModelResponse, ToolCallRequest


class OpenAIResponsesAdapter(HttpAdapter):
    """OpenAI's Responses API."""

    provider = "openai"
    default_base_url = "https://api.openai.com/v1"
    path = "/responses"

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self._key.reveal()}"} if self._key else {}

    def render(self, request: ModelRequest, items: list[Item]) -> dict[str, Any]:
        wire: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, UserText):
                wire.append({"role": "user", "content": item.text})
            elif isinstance(item, Context):
                wire.append({"role": "developer", "content": item.text})
            else:
                if item.text:
                    wire.append({"role": "assistant", "content": item.text})
                wire += [
                    {
                        "type": "function_call",
                        "call_id": c.id,
                        "name": c.name,
                        "arguments": c.arguments_json,
                    }
                    for c in item.calls
                ]
                wire += [
                    {"type": "function_call_output", "call_id": r.call_id, "output": r.content}
                    for r in item.results
                ]
        body: dict[str, Any] = {"model": self.model, "input": wire, "store": False}
        if request.instructions:
            body["instructions"] = request.instructions
        if request.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                    # strict mode needs every property required and no extras: our schemas
                    # come from pydantic models with optional fields.
                    "strict": False,
                }
                for t in request.tools
            ]
        if self.max_tokens is not None:
            body["max_output_tokens"] = self.max_tokens
        return body

    def parse(self, body: Any) -> ModelResponse:
        if body.get("status") == "failed":
            raise self.stream_error(body.get("error"))
        return _response(body.get("output") or [], _usage(body.get("usage")))

    def assembler(self) -> StreamAssembler:
        return _ResponsesStream(self)


def _response(output: list[Any], used: dict[str, int]) -> ModelResponse:
    text: list[str] = []
    calls: list[ToolCallRequest] = []
    for item in output:
        if item.get("type") == "message":
            for part in item.get("content") or []:
                if part.get("type") == "output_text":
                    text.append(part.get("text", ""))
                elif part.get("type") == "refusal":
                    text.append(part.get("refusal", ""))
        elif item.get("type") == "function_call":
            calls.append(tool_call(item["name"], item.get("arguments"), item.get("call_id")))
    return ModelResponse(text="".join(text), tool_calls=calls, usage=used)


def _usage(raw: Any) -> dict[str, int]:
    if not raw:
        return {}
    cached = (raw.get("input_tokens_details") or {}).get("cached_tokens")
    return usage(raw.get("input_tokens"), raw.get("output_tokens"), cached)


class _ResponsesStream(StreamAssembler):
    def __init__(self, adapter: OpenAIResponsesAdapter) -> None:
        self.adapter = adapter
        self.items: dict[int, dict[str, Any]] = {}
        self.finished: set[int] = set()
        self.texts: dict[int, list[str]] = {}
        self.arguments: dict[int, list[str]] = {}
        self.usage: dict[str, int] = {}

    def feed(self, event: SseEvent) -> str | None:
        data = json.loads(event.data)
        kind = data.get("type") or event.event
        index = data.get("output_index", 0)
        if kind == "response.output_item.added":
            self.items.setdefault(index, data["item"])
        elif kind == "response.output_item.done":
            self.items[index] = data["item"]
            self.finished.add(index)
        elif kind == "response.output_text.delta":
            self.texts.setdefault(index, []).append(data["delta"])
            return str(data["delta"]) or None
        elif kind == "response.function_call_arguments.delta":
            self.arguments.setdefault(index, []).append(data["delta"])
        elif kind in ("response.completed", "response.incomplete"):
            self.usage = _usage(data["response"].get("usage"))
            self.done = True
        elif kind == "response.failed":
            raise self.adapter.stream_error(data["response"].get("error"))
        elif kind == "error":
            raise self.adapter.stream_error(data)
        return None

    def response(self) -> ModelResponse:
        output: list[Any] = []
        for index in sorted(self.items.keys() | self.texts.keys()):
            item = self.items.get(index, {"type": "message"})
            if index in self.finished:
                output.append(item)
            elif item.get("type") == "message":
                # Never closed by output_item.done: keep the text that did arrive.
                text = "".join(self.texts.get(index, []))
                output.append({**item, "content": [{"type": "output_text", "text": text}]})
            elif item.get("type") == "function_call":
                output.append({**item, "arguments": "".join(self.arguments.get(index, []))})
        return _response(output, self.usage)
