"""A scripted model provider on 127.0.0.1, port 0: what every fake provider server shares.

A test scripts outcomes in provider-neutral terms (``Reply``, ``Failure``, ``Stall``, or a
``Raw`` body); each
fake (``openai_chat``, ``openai_responses``, ``anthropic``) renders them in its provider's
exact wire format, streamed or not, and checks every request the way its provider does,
answering a broken one with the provider's own 400 error. ``received`` keeps every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, Self

from aiohttp import web


@dataclass(frozen=True)
class FakeCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    # Sent verbatim as the arguments instead of their JSON: a model writing broken JSON.
    raw: str | None = None

    def arguments_json(self) -> str:
        return self.raw if self.raw is not None else json.dumps(self.arguments)


@dataclass(frozen=True)
class Reply:
    text: str = ""
    calls: tuple[FakeCall, ...] = ()
    usage: tuple[int, int] = (11, 7)
    # Streaming only: stop after the content, before the provider's closing events.
    cut: bool = False
    # Streaming only: an error event (type, message) after the content.
    stream_error: tuple[str, str] | None = None
    # Seconds the provider takes before it answers (``in_flight`` counts the calls meanwhile).
    delay: float = 0.0


@dataclass(frozen=True)
class Failure:
    status: int
    message: str
    error_type: str = "invalid_request_error"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Stall:
    """Hold the request unanswered until the server closes (the client's timeout fires) or
    the client goes away (counted in ``abandoned``)."""


@dataclass(frozen=True)
class Raw:
    """Answer with exactly this JSON and status: a body the provider's documents do not allow."""

    body: Any
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


Outcome = Reply | Failure | Stall | Raw


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    at: float = field(default_factory=time.time)  # when it arrived (Unix time)


def pieces(text: str, size: int = 4) -> Iterator[str]:
    """Text cut in small pieces, as a provider streams it."""
    for i in range(0, len(text), size):
        yield text[i : i + size]


class FakeProvider(ABC):
    """One provider's HTTP API, scripted: ``async with FakeX() as fake: fake.script(Reply(…))``."""

    path: ClassVar[str]
    # What the provider's SDKs call the base URL: OpenAI's includes /v1, Anthropic's does not.
    base_path: ClassVar[str]

    def __init__(self, api_key: str = "sk-fake-0123456789", *, id_style: str = "provider") -> None:
        self.api_key = api_key
        # "positional": ids like "functions.<name>:<index>", repeated every response (the
        # style of some OpenAI-compatible servers).
        self.id_style = id_style
        self.received: list[Received] = []
        # Stalled requests whose client closed the connection before an answer: cancelled.
        self.abandoned = 0
        # The usage of every answer sent whole, in order: what the provider bills.
        self.billed: list[tuple[int, int]] = []
        # Calls being answered now (a ``Reply`` with a ``delay``), and the most at once.
        self.in_flight = 0
        self.most_in_flight = 0
        self._outcomes: deque[Outcome] = deque()
        self._released = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._port = 0
        self._ids = 0

    # -- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        app = web.Application()
        app.router.add_post(self.path, self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._port = self._runner.addresses[0][1]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        # Release stalled handlers first: cleanup waits for every handler to return.
        self._released.set()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._port}{self.base_path}"

    def script(self, *outcomes: Outcome) -> None:
        self._outcomes.extend(outcomes)

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [r.body for r in self.received]

    def new_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}{self._ids:04d}fake"

    # -- what each provider says ------------------------------------------------------------

    @abstractmethod
    def authorized(self, request: web.Request) -> bool: ...

    @abstractmethod
    def validate(self, request: web.Request, body: dict[str, Any]) -> str | None:
        """The provider's error message for a request it would refuse, else None."""

    @abstractmethod
    def error_body(self, status: int, message: str, error_type: str) -> dict[str, Any]: ...

    @abstractmethod
    def unauthorized_message(self, request: web.Request) -> str: ...

    @abstractmethod
    def render(self, reply: Reply, body: dict[str, Any]) -> dict[str, Any]: ...

    @abstractmethod
    def events(self, reply: Reply, body: dict[str, Any]) -> Iterable[tuple[str | None, Any]]:
        """The SSE events (name, JSON data or a raw string) of a streamed reply."""

    # -- the server ---------------------------------------------------------------------------

    def error(
        self, status: int, message: str, error_type: str, headers: dict[str, str] | None = None
    ) -> web.Response:
        return web.json_response(
            self.error_body(status, message, error_type),
            status=status,
            headers={"x-request-id": "req_fake", **(headers or {})},
        )

    async def _stall(self, request: web.Request) -> None:
        """Until the server closes, or the client closes the connection (looked at every
        20 ms: aiohttp does not cancel a handler whose client left)."""
        try:
            while not self._released.is_set():
                transport = request.transport
                if transport is None or transport.is_closing():
                    self.abandoned += 1
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._released.wait(), 0.02)
        except asyncio.CancelledError:
            self.abandoned += 1
            raise

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return self.error(400, "We could not parse the JSON body of your request.", "invalid")
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.received.append(Received(request.path, headers, body))
        if not self.authorized(request):
            return self.error(401, self.unauthorized_message(request), "authentication_error")
        problem = self.validate(request, body)
        if problem is not None:
            return self.error(400, problem, "invalid_request_error")
        if not self._outcomes:
            return self.error(500, "the fake provider has no scripted outcome left", "api_error")
        outcome = self._outcomes.popleft()
        if isinstance(outcome, Failure):
            return self.error(outcome.status, outcome.message, outcome.error_type, outcome.headers)
        if isinstance(outcome, Raw):
            return web.json_response(outcome.body, status=outcome.status, headers=outcome.headers)
        if isinstance(outcome, Stall):
            await self._stall(request)
            return self.error(503, "the fake provider closed", "api_error")
        if outcome.delay:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                await asyncio.sleep(outcome.delay)
            finally:
                self.in_flight -= 1
        if not body.get("stream"):
            rendered = self.render(outcome, body)
            self.billed.append(outcome.usage)
            return web.json_response(rendered)
        response = web.StreamResponse(
            headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        await response.prepare(request)
        await response.write(b": a keep-alive comment, which clients ignore\n\n")
        for name, data in self.events(outcome, body):
            line = data if isinstance(data, str) else json.dumps(data)
            head = f"event: {name}\n" if name else ""
            frame = f"{head}data: {line}\n\n".encode()
            # Two writes per event: the client's parser must not rely on whole frames.
            await response.write(frame[: len(frame) // 2])
            await response.write(frame[len(frame) // 2 :])
        await response.write_eof()
        if not outcome.cut and outcome.stream_error is None:
            self.billed.append(outcome.usage)
        return response
