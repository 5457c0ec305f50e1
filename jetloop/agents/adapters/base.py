"""What every HTTP model adapter shares: the session, the key, errors, SSE and arguments.

A provider adapter (``openai_chat``, ``openai_responses``, ``anthropic``) only says how to
build its request body, read its response, and assemble its stream; ``HttpAdapter`` does the
I/O through one seam (``_send``), so each provider's fake server is the only fake a test needs.

The adapter does not retry: the engine already retries a failed model step with backoff
(one retry loop, not two). The adapter's job is to classify the failure — ``ProviderRetryable``
with the provider's ``Retry-After``, or ``ProviderRejected`` with the provider's message — so
that the engine decides the step's fate in one place (docs/design.md).

Connections: ``async with adapter:`` keeps one connection pool for the block (a worker's
lifetime); outside such a block each call opens and closes its own session, so an adapter can
be built at import time without touching the network or an event loop.
"""

from __future__ import annotations

import email.utils
import json
import time
from abc import ABC, abstractmethod
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Mapping,
)
from contextlib import aclosing, asynccontextmanager, contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar, Self

import aiohttp
import structlog
from pydantic import SecretStr

from jetloop.agents.adapters.history import Item, conversation
from jetloop.agents.model import Message, ModelRequest, ModelResponse, ToolCallRequest
from jetloop.schemas.errors import ProviderError, ProviderRejected, ProviderRetryable

log = structlog.get_logger("jetloop.adapters")

DeltaHandler = Callable[[str], Awaitable[None]]
"""Called with each piece of answer text as the provider streams it."""

# Statuses the provider SDKs retry as well: a timeout, a lock conflict, rate limits, outages.
RETRYABLE_STATUS = frozenset({408, 409, 429})
# Error types that are never worth another attempt even with a retryable status: an account
# out of credit answers 429 until someone pays.
REJECTED_TYPES = frozenset({"insufficient_quota", "billing_error", "permission_error"})


@dataclass(frozen=True)
class MalformedToolCall(ToolCallRequest):
    """A call whose arguments were not a JSON object: ``arguments`` is ``{}``.

    The engine should record the call as failed with ``problem`` (so the model sees what it
    got wrong) rather than run the tool with empty arguments.
    """

    raw_arguments: str = ""
    problem: str = ""


def tool_call(
    name: str, raw: str | Mapping[str, Any] | None, provider_id: str | None
) -> ToolCallRequest:
    """A ``ToolCallRequest`` from provider arguments; never raises on what the model wrote."""
    if raw is None or raw == "":
        # OpenAI-compatible servers send "" for a tool without parameters.
        return ToolCallRequest(name=name, arguments={}, provider_id=provider_id)
    if isinstance(raw, Mapping):
        return ToolCallRequest(name=name, arguments=dict(raw), provider_id=provider_id)
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as exc:
        problem = f"the arguments of {name} are not valid JSON ({exc.msg} at {exc.pos})"
        return MalformedToolCall(name, {}, provider_id, raw_arguments=raw, problem=problem)
    if not isinstance(parsed, dict):
        problem = f"the arguments of {name} are JSON but not an object"
        return MalformedToolCall(name, {}, provider_id, raw_arguments=raw, problem=problem)
    return ToolCallRequest(name=name, arguments=parsed, provider_id=provider_id)


class Secret:
    """An API key that never shows itself in ``str``, ``repr`` or a traceback's locals."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def scrub(self, text: str) -> str:
        return text.replace(self._value, "***") if self._value else text

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


@dataclass(frozen=True)
class SseEvent:
    event: str | None
    data: str


async def sse_events(chunks: AsyncIterable[bytes]) -> AsyncGenerator[SseEvent, None]:
    """Server-sent events from a byte stream, however the bytes are split (LF or CRLF).

    Not ``StreamReader.readline``: its 64 KiB line limit is smaller than a Responses API
    ``response.completed`` event for a long answer.
    """
    buffer = bytearray()
    event: str | None = None
    data: list[str] = []
    async for chunk in chunks:
        buffer += chunk
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            line = buffer[start:end].rstrip(b"\r").decode()
            start = end + 1
            if not line:
                if data:
                    yield SseEvent(event, "\n".join(data))
                event, data = None, []
            elif line.startswith(":"):
                continue  # a comment: keep-alive
            else:
                name, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if name == "event":
                    event = value
                elif name == "data":
                    data.append(value)
        del buffer[:start]
    # An event the stream cut off before its blank line is dropped, as the SSE spec says:
    # the assembler then sees no closing event and reports the stream as cut.


def retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds to wait, from ``retry-after-ms`` (OpenAI) or ``Retry-After`` (seconds or date)."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def usage(input_tokens: Any, output_tokens: Any, cached: Any = None) -> dict[str, int]:
    """``ModelResponse.usage``: input counts every prompt token, cached ones included."""
    out = {"input_tokens": int(input_tokens or 0), "output_tokens": int(output_tokens or 0)}
    if cached:
        out["cached_input_tokens"] = int(cached)
    return out


class StreamAssembler(ABC):
    """Builds one ``ModelResponse`` from a provider's stream of events."""

    done: bool = False

    @abstractmethod
    def feed(self, event: SseEvent) -> str | None:
        """Take one event; return the answer text it adds, if any; raise if it is an error."""

    @abstractmethod
    def response(self) -> ModelResponse: ...


class HttpAdapter(ABC):
    """A ``ModelAdapter`` over a provider's HTTP API (aiohttp, no SDK)."""

    provider: ClassVar[str]
    default_base_url: ClassVar[str]
    path: ClassVar[str]
    # The engine streams only through adapters that say so (``complete(..., on_delta=…)``).
    supports_streaming: ClassVar[bool] = True

    def __init__(
        self,
        model: str,
        *,
        api_key: str | SecretStr | None = None,
        base_url: str | None = None,
        max_tokens: int | None = None,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
        extra_body: Mapping[str, Any] | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        if not model:
            raise ValueError(f"{self.provider}: a model name is required")
        self.model = model
        key = api_key.get_secret_value() if isinstance(api_key, SecretStr) else api_key
        self._key = Secret(key.strip()) if key else None
        self.base_url = (base_url or self.default_base_url).rstrip("/")
        self.max_tokens = max_tokens
        # total caps the whole call; sock_read is the longest silence allowed mid-stream.
        self.timeout = aiohttp.ClientTimeout(
            total=timeout, connect=connect_timeout, sock_read=read_timeout
        )
        self.extra_body = dict(extra_body or {})
        self._given_session = session
        self._own_session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        key = "'***'" if self._key else "None"
        return (
            f"{type(self).__name__}(model={self.model!r}, base_url={self.base_url!r}, "
            f"api_key={key})"
        )

    async def __aenter__(self) -> Self:
        if self._given_session is None and self._own_session is None:
            self._own_session = aiohttp.ClientSession()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the session this adapter opened (never one it was given); idempotent."""
        session, self._own_session = self._own_session, None
        if session is not None:
            await session.close()

    # -- what a provider says ---------------------------------------------------------------

    @abstractmethod
    def headers(self) -> dict[str, str]:
        """The provider's headers, the API key among them."""

    @abstractmethod
    def render(self, request: ModelRequest, items: list[Item]) -> dict[str, Any]:
        """The request body, without the ``stream`` flag."""

    @abstractmethod
    def parse(self, body: Any) -> ModelResponse:
        """A non-streamed response body."""

    @abstractmethod
    def assembler(self) -> StreamAssembler: ...

    def stream_options(self) -> dict[str, Any]:
        return {"stream": True}

    # -- the seam -------------------------------------------------------------------------

    def body(self, request: ModelRequest, *, stream: bool = False) -> dict[str, Any]:
        """The exact JSON the provider receives for ``request``."""
        items = conversation(
            request.messages,
            tools_enabled=bool(request.tools),
            summary=request.purpose == "summary",
        )
        body = {**self.render(request, items), **self.extra_body}
        if stream:
            body.update(self.stream_options())
        return body

    async def complete(
        self, request: ModelRequest, on_delta: DeltaHandler | None = None
    ) -> ModelResponse:
        """Ask the model; with ``on_delta``, stream and hand over the text as it comes."""
        body = self.body(request, stream=on_delta is not None)
        async with self._send(body) as response:
            if on_delta is None:
                try:
                    raw = await response.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise self._lost(exc) from None
                with self._reading():
                    return self.parse(json.loads(raw))
            assembler = self.assembler()
            async with aclosing(self._events(response)) as events:
                async for event in events:
                    with self._reading():
                        delta = assembler.feed(event)
                    # The hook runs outside the I/O guard: its own failures are not the
                    # provider's and must not be mistaken for a lost connection.
                    if delta:
                        await on_delta(delta)
                    if assembler.done:
                        break
            if not assembler.done:
                raise ProviderRetryable(self.provider, "the stream ended before the answer did")
            with self._reading():
                return assembler.response()

    def estimate_tokens(self, messages: list[Message]) -> int:
        """About four characters a token, of the messages as this provider receives them."""
        items = conversation(messages)
        request = ModelRequest(agent="", instructions="", messages=[], tools=[], attempt=0)
        return len(json.dumps(self.render(request, items), ensure_ascii=False)) // 4

    @asynccontextmanager
    async def _send(self, body: dict[str, Any]) -> AsyncIterator[aiohttp.ClientResponse]:
        url = self.base_url + self.path
        headers = {"content-type": "application/json", **self.headers()}
        async with self._session() as session:
            try:
                response = await session.post(url, json=body, headers=headers, timeout=self.timeout)
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise self._lost(exc) from None
            async with response:
                if response.status >= 400:
                    raise await self._failure(response)
                yield response

    @asynccontextmanager
    async def _session(self) -> AsyncIterator[aiohttp.ClientSession]:
        session = self._given_session or self._own_session
        if session is not None:
            yield session
            return
        async with aiohttp.ClientSession() as own:
            yield own

    async def _events(self, response: aiohttp.ClientResponse) -> AsyncGenerator[SseEvent, None]:
        try:
            async with aclosing(sse_events(response.content.iter_any())) as events:
                async for event in events:
                    yield event
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._lost(exc) from None

    # -- errors -----------------------------------------------------------------------------

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """A body unlike the provider's documented shape is the provider's fault: retryable."""
        try:
            yield
        except ProviderError:
            raise
        except (ValueError, LookupError, TypeError, AttributeError) as exc:
            raise self._unreadable(exc) from None

    def scrub(self, text: str) -> str:
        return self._key.scrub(text) if self._key else text

    def _lost(self, exc: BaseException) -> ProviderRetryable:
        what = "timed out" if isinstance(exc, TimeoutError) else "connection failed"
        detail = self.scrub(str(exc)) or type(exc).__name__
        log.warning("model.provider_unreachable", provider=self.provider, error=detail)
        return ProviderRetryable(self.provider, f"{what}: {detail}")

    def _unreadable(self, exc: BaseException) -> ProviderRetryable:
        detail = self.scrub(f"{type(exc).__name__}: {exc}")
        return ProviderRetryable(self.provider, f"the response could not be read ({detail})")

    def stream_error(self, error: Any) -> ProviderError:
        """An error event inside a stream (the HTTP status was already 200)."""
        message, error_type = _message_and_type(error)
        text = self.scrub(message or "the stream reported an error")
        # An unknown type mid-stream is more likely an outage than a fault in our request.
        if error_type in REJECTED_TYPES or "invalid" in (error_type or ""):
            return ProviderRejected(self.provider, text, error_type=error_type)
        return ProviderRetryable(self.provider, text, error_type=error_type)

    async def _failure(self, response: aiohttp.ClientResponse) -> ProviderError:
        status = response.status
        try:
            raw = await response.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            raw = ""
        try:
            message, error_type = _message_and_type(json.loads(raw).get("error"))
        except (ValueError, AttributeError):
            message, error_type = None, None
        message = self.scrub(message or raw[:500] or response.reason or "no message")
        request_id = response.headers.get("x-request-id") or response.headers.get("request-id")
        should_retry = response.headers.get("x-should-retry")
        retryable = status in RETRYABLE_STATUS or status >= 500
        if should_retry in ("true", "false"):
            retryable = should_retry == "true"
        if error_type in REJECTED_TYPES:
            retryable = False
        wait = retry_after(response.headers) if retryable else None
        log.warning(
            "model.provider_error",
            provider=self.provider,
            status=status,
            error_type=error_type,
            retry_after=wait,
            request_id=request_id,
        )
        if retryable:
            return ProviderRetryable(
                self.provider,
                message,
                retry_after=wait,
                status=status,
                error_type=error_type,
                request_id=request_id,
            )
        return ProviderRejected(
            self.provider, message, status=status, error_type=error_type, request_id=request_id
        )


def _message_and_type(error: Any) -> tuple[str | None, str | None]:
    """The message and type of ``{"message", "type" | "code"}`` (OpenAI and Anthropic agree)."""
    if isinstance(error, str):
        return error, None
    if not isinstance(error, dict):
        return None, None
    message = error.get("message")
    kind = error.get("code") or error.get("type")
    return (str(message) if message else None), (str(kind) if kind else None)
