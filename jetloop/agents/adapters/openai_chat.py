"""OpenAI Chat Completions (``POST {base_url}/chat/completions``), and every server that copies it.

Mapping of the jetloop history:

- instructions, notes and the summary → ``system`` messages where they occur (OpenAI maps
  ``system`` to ``developer`` for the models that want it; compatible servers know ``system``);
- user text → ``user``; an assistant message → ``assistant`` with ``content`` and ``tool_calls``
  (arguments as a JSON string);
- each result → a ``tool`` message with ``tool_call_id``, right after its assistant message,
  status words in front of the content (see ``history.result_content``).

Streaming uses ``stream: true`` with ``stream_options.include_usage`` and assembles each tool
call from its ``choices[0].delta.tool_calls[index]`` fragments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from jetloop.agents.adapters.base import (
    HttpAdapter,
    SseEvent,
    StreamAssembler,
    tool_call,
    usage,
)
from jetloop.agents.adapters.history import Context, Exchange, Item, UserText
from jetloop.agents.model import ModelRequest, ModelResponse


class OpenAIChatAdapter(HttpAdapter):
    """OpenAI Chat Completions; also vLLM, Ollama, LiteLLM and other compatible servers."""

    provider = "openai"
    default_base_url = "https://api.openai.com/v1"
    path = "/chat/completions"

    def headers(self) -> dict[str, str]:
        # A compatible server on localhost may need no key at all.
        return {"authorization": f"Bearer {self._key.reveal()}"} if self._key else {}

    def render(self, request: ModelRequest, items: list[Item]) -> dict[str, Any]:
        messages: list[dict[str, Any]] = []
        if request.instructions:
            messages.append({"role": "system", "content": request.instructions})
        for item in items:
            if isinstance(item, UserText):
                messages.append({"role": "user", "content": item.text})
            elif isinstance(item, Context):
                messages.append({"role": "system", "content": item.text})
            else:
                messages += _exchange(item)
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if request.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.parameters,
                    },
                }
                for t in request.tools
            ]
        if self.max_tokens is not None:
            body["max_completion_tokens"] = self.max_tokens
        return body

    def stream_options(self) -> dict[str, Any]:
        # Without include_usage a streamed answer reports no token counts at all.
        return {"stream": True, "stream_options": {"include_usage": True}}

    def parse(self, body: Any) -> ModelResponse:
        choice = body["choices"][0]
        message = choice["message"]
        calls = [
            tool_call(c["function"]["name"], c["function"].get("arguments"), c.get("id"))
            for c in message.get("tool_calls") or []
        ]
        return ModelResponse(
            text=_text(message.get("content")) or message.get("refusal") or "",
            tool_calls=calls,
            usage=_usage(body.get("usage")),
        )

    def assembler(self) -> StreamAssembler:
        return _ChatStream(self)


def _exchange(item: Exchange) -> list[dict[str, Any]]:
    assistant: dict[str, Any] = {"role": "assistant", "content": item.text or None}
    if item.calls:
        assistant["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments_json},
            }
            for c in item.calls
        ]
    results = [
        {"role": "tool", "tool_call_id": r.call_id, "content": r.content} for r in item.results
    ]
    return [assistant, *results]


def _text(content: Any) -> str:
    # Some compatible servers answer with a list of parts instead of a string.
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _usage(raw: Any) -> dict[str, int]:
    if not raw:
        return {}
    cached = (raw.get("prompt_tokens_details") or {}).get("cached_tokens")
    return usage(raw.get("prompt_tokens"), raw.get("completion_tokens"), cached)


@dataclass
class _Fragment:
    id: str | None = None
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class _ChatStream(StreamAssembler):
    def __init__(self, adapter: OpenAIChatAdapter) -> None:
        self.adapter = adapter
        self.text: list[str] = []
        self.calls: dict[int, _Fragment] = {}
        self.usage: dict[str, int] = {}

    def feed(self, event: SseEvent) -> str | None:
        if event.data == "[DONE]":
            self.done = True
            return None
        chunk = json.loads(event.data)
        if chunk.get("error"):
            raise self.adapter.stream_error(chunk["error"])
        if chunk.get("usage"):
            self.usage = _usage(chunk["usage"])
        out: list[str] = []
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if text := _text(delta.get("content")):
                out.append(text)
            for piece in delta.get("tool_calls") or []:
                frag = self.calls.setdefault(piece.get("index", len(self.calls)), _Fragment())
                # The id and name come whole in the first fragment; later ones only repeat
                # them (some servers) or leave them out (OpenAI), so the first one wins.
                frag.id = frag.id or piece.get("id")
                fn = piece.get("function") or {}
                frag.name = frag.name or fn.get("name") or ""
                if fn.get("arguments"):
                    frag.arguments.append(fn["arguments"])
        self.text += out
        return "".join(out) or None

    def response(self) -> ModelResponse:
        calls = [
            tool_call(f.name, "".join(f.arguments), f.id) for _, f in sorted(self.calls.items())
        ]
        return ModelResponse(text="".join(self.text), tool_calls=calls, usage=self.usage)
