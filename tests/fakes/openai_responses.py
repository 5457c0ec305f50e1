"""A fake OpenAI Responses server: ``POST /v1/responses``, bearer auth.

Checks what the Responses API checks about tools (flat function tools with a ``name``; every
``function_call_output`` matched by ``call_id`` to an earlier ``function_call``; every
``function_call`` answered; item ids of the ``fc`` kind) with OpenAI's error wording; answers
with ``response`` objects or the event stream (``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta``,
``response.output_item.done``, ``response.completed``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from aiohttp import web

from tests.fakes.base import FakeProvider, Reply, pieces

ROLES = ("assistant", "system", "developer", "user")


class FakeOpenAIResponses(FakeProvider):
    path = "/v1/responses"
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
        if "messages" in body:
            return (
                "Unsupported parameter: 'messages'. In the Responses API, this parameter has "
                "moved to 'input'."
            )
        for i, t in enumerate(body.get("tools") or []):
            if t.get("type") == "function" and "name" not in t:
                return f"Missing required parameter: 'tools[{i}].name'."
        items = body.get("input")
        if isinstance(items, str):
            return None
        if not isinstance(items, list):
            return "Invalid type for 'input': expected a string or an array."
        answered: dict[str, bool] = {}
        for i, item in enumerate(items):
            kind = item.get("type", "message")
            if kind == "message":
                if item.get("role") not in ROLES:
                    return (
                        f"Invalid value: '{item.get('role')}'. Supported values are: "
                        f"{', '.join(ROLES)}."
                    )
                if not isinstance(item.get("content"), str | list):
                    return f"Invalid type for 'input[{i}].content'."
            elif kind == "function_call":
                for key in ("call_id", "name", "arguments"):
                    if not isinstance(item.get(key), str):
                        return f"Missing required parameter: 'input[{i}].{key}'."
                if "id" in item and not str(item["id"]).startswith("fc"):
                    return f"Invalid 'input[{i}].id': Expected an ID that begins with 'fc'."
                answered[item["call_id"]] = False
            elif kind == "function_call_output":
                cid = item.get("call_id")
                if cid not in answered:
                    return f"No tool call found for function call output with call_id {cid}."
                if not isinstance(item.get("output"), str | list):
                    return f"Invalid type for 'input[{i}].output'."
                answered[cid] = True
            else:
                return f"Invalid value: '{kind}'."
        for cid, done in answered.items():
            if not done:
                return f"No tool output found for function call {cid}."
        return None

    def _output(self, reply: Reply) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if reply.text:
            out.append(
                {
                    "type": "message",
                    "id": self.new_id("msg_"),
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": reply.text, "annotations": []}],
                }
            )
        for k, c in enumerate(reply.calls):
            positional = self.id_style == "positional"
            out.append(
                {
                    "type": "function_call",
                    "id": self.new_id("fc_"),
                    "call_id": f"functions.{c.name}:{k}" if positional else self.new_id("call_"),
                    "name": c.name,
                    "arguments": c.arguments_json(),
                    "status": "completed",
                }
            )
        return out

    def _response(
        self, reply: Reply, body: dict[str, Any], output: list[dict[str, Any]], status: str
    ) -> dict[str, Any]:
        prompt, completion = reply.usage
        return {
            "id": "resp_fake",
            "object": "response",
            "created_at": 1_700_000_000,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": body["model"],
            "output": output,
            "parallel_tool_calls": True,
            "store": body.get("store", True),
            "usage": {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion,
            },
        }

    def render(self, reply: Reply, body: dict[str, Any]) -> dict[str, Any]:
        return self._response(reply, body, self._output(reply), "completed")

    def events(self, reply: Reply, body: dict[str, Any]) -> Iterable[tuple[str | None, Any]]:
        seq = iter(range(1_000_000))

        def event(kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
            return kind, {"type": kind, "sequence_number": next(seq), **data}

        output = self._output(reply)
        yield event("response.created", response=self._response(reply, body, [], "in_progress"))
        for index, item in enumerate(output):
            yield from self._item_events(event, index, item)
        if reply.stream_error is not None:
            kind, message = reply.stream_error
            failed = self._response(reply, body, output, "failed")
            failed["error"] = {"code": kind, "message": message}
            yield event("response.failed", response=failed)
            return
        if reply.cut:
            return
        yield event("response.completed", response=self._response(reply, body, output, "completed"))

    def _item_events(
        self, event: Any, index: int, item: dict[str, Any]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "content": []},
            )
            part = {"type": "output_text", "text": "", "annotations": []}
            yield event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
            for piece in pieces(text):
                yield event(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    delta=piece,
                )
            yield event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=text,
            )
        else:
            yield event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            for piece in pieces(item["arguments"], 5):
                yield event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=piece,
                )
            yield event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
            )
        yield event("response.output_item.done", output_index=index, item=item)
