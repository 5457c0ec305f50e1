"""Traces of turns, for the tracing tools people already run (OpenTelemetry, OTLP).

On when the ``otel`` extra is installed and an OTLP endpoint is set
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; every other
standard ``OTEL_*`` setting applies too: headers, service name, batch delays), or
``OTEL_TRACES_EXPORTER=console`` prints each span on the worker's output; off
otherwise, and then nothing of OpenTelemetry is imported and a step pays one ``None`` check.

A turn is one trace. Its spans are made by whichever processes run its steps, so their ids
come from the turn's identity, not from one process's memory: the trace id is the caller's
(the ``traceparent`` given with the message, kept in the turn record) or one derived from
the session and turn ids; the turn span's id is derived from them too, and every step's span
names it as parent before it is itself exported (when the turn ends, from the time a worker
accepted it). A model call is a ``chat <model>`` span with the GenAI semantic
conventions' attributes (``gen_ai.operation.name``, ``gen_ai.request.model``,
``gen_ai.usage.input_tokens``/``output_tokens``, ``gen_ai.response.finish_reasons`` …), a
tool call an ``execute_tool <tool>`` span with its effect and idempotency key, and each has
jetloop's own (``jetloop.session_id``, ``jetloop.turn_id``, ``jetloop.step_key``,
``jetloop.attempt``, and ``jetloop.outcome``: ``succeeded`` or ``failed``, of that attempt).
An attempt's span id is derived from its step and attempt number, so an
attempt made again after a crash is a new span with a link to the first attempt's, even when
the first was never exported (its worker died holding it).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import time
from collections.abc import Iterator
from typing import Any

import structlog

from jetloop.agents import ModelRequest, ModelResponse
from jetloop.schemas import PlannedCall, TurnRecord, TurnStatus
from jetloop.schemas.ids import parse_traceparent

log = structlog.get_logger("jetloop.tracing")

ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

# The ids the next span made in this context takes (see ``_FixedIds``).
_NEXT: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "jetloop_next_span_ids", default=None
)


def _derived(text: str, bits: int) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[: bits // 8], "big") or 1


def trace_id_of(turn: TurnRecord) -> int:
    given = parse_traceparent(turn.traceparent)
    if given is not None:
        return given[0]
    return _derived(f"trace:{turn.session_id}.{turn.turn_id}", 128)


def turn_span_id(turn: TurnRecord) -> int:
    return _derived(f"turn:{turn.session_id}.{turn.turn_id}", 64)


def attempt_span_id(step_key: str, attempt: int) -> int:
    return _derived(f"step:{step_key}.a{attempt}", 64)


class Tracing:
    """The tracer of one process, its provider, and how jetloop's spans are made."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import trace

        self.provider = provider
        self.tracer = provider.get_tracer("jetloop")
        self._trace = trace

    @classmethod
    def from_env(cls, service: str) -> Tracing | None:
        """On when the ``otel`` extra is installed and an OTLP endpoint is set, or
        ``OTEL_TRACES_EXPORTER`` names ``console`` (each span printed as JSON on the worker's
        standard output, to look at traces with no collector) or ``otlp``; ``none`` (or
        ``OTEL_SDK_DISABLED=true``) turns it off."""
        exporters = {
            e.strip().lower()
            for e in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")
            if e.strip()
        }
        if not exporters:
            exporters = {"otlp"} if any(os.environ.get(k) for k in ENDPOINTS) else set()
        exporters.discard("none")
        if not exporters or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return None
        unknown = exporters - {"otlp", "console"}
        if unknown:
            log.warning(
                "tracing.exporter_unknown",
                exporters=sorted(unknown),
                hint="OTEL_TRACES_EXPORTER takes otlp, console or none",
            )
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import (
                BatchSpanProcessor,
                ConsoleSpanExporter,
                SimpleSpanProcessor,
            )

            if "otlp" in exporters:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
        except ImportError as exc:
            log.warning(
                "tracing.unavailable",
                error=str(exc),
                fix="pip install 'jetloop[otel]' (traces were asked for)",
            )
            return None
        name = os.environ.get("OTEL_SERVICE_NAME") or service
        provider = TracerProvider(
            resource=Resource.create({"service.name": name}), id_generator=_fixed_ids()
        )
        if "otlp" in exporters:
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        if "console" in exporters:
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        log.info("tracing.on", service=name, exporters=sorted(exporters & {"otlp", "console"}))
        return cls(provider)

    def shutdown(self) -> None:
        """Export what is left (blocking: run it on a thread)."""
        self.provider.shutdown()

    # --- spans ---------------------------------------------------------------------------

    def _parent(self, turn: TurnRecord) -> Any:
        from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

        ctx = SpanContext(
            trace_id_of(turn), turn_span_id(turn), is_remote=True, trace_flags=TraceFlags(1)
        )
        return self._trace.set_span_in_context(NonRecordingSpan(ctx))

    def _links(self, turn: TurnRecord, step_key: str, attempt: int) -> list[Any]:
        if attempt <= 1:
            return []
        from opentelemetry.trace import Link, SpanContext, TraceFlags

        first = SpanContext(
            trace_id_of(turn),
            attempt_span_id(step_key, 1),
            is_remote=True,
            trace_flags=TraceFlags(1),
        )
        return [Link(first, {"jetloop.link": "first attempt"})]

    def _start(self, turn: TurnRecord, span_id: int, name: str, **kw: Any) -> Any:
        """Start a span of ``turn``'s trace whose id is ``span_id`` (derived, so every process
        names the same span the same way), with the turn's ids among its attributes."""
        attributes = {
            "jetloop.session_id": turn.session_id,
            "jetloop.turn_id": turn.turn_id,
            "jetloop.agent": turn.agent,
            **kw.pop("attributes", {}),
        }
        token = _NEXT.set((trace_id_of(turn), span_id))
        try:
            return self.tracer.start_span(name, attributes=attributes, **kw)
        finally:
            _NEXT.reset(token)

    @contextlib.contextmanager
    def _span(
        self, name: str, turn: TurnRecord, step_key: str, attempt: int, attrs: dict[str, Any]
    ) -> Iterator[Any]:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        span = self._start(
            turn,
            attempt_span_id(step_key, attempt),
            name,
            context=self._parent(turn),
            kind=SpanKind.CLIENT if name.startswith("chat") else SpanKind.INTERNAL,
            links=self._links(turn, step_key, attempt),
            attributes={
                "jetloop.step_key": step_key,
                "jetloop.attempt": attempt,
                "jetloop.repeated": attempt > 1,
                **attrs,
            },
        )
        try:
            yield span
        except BaseException as exc:
            span.set_attribute("jetloop.outcome", "failed")
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        else:
            span.set_attribute("jetloop.outcome", "succeeded")
        finally:
            span.end()

    def model_call(self, turn: TurnRecord, request: ModelRequest, adapter: Any) -> Any:
        model = getattr(adapter, "model", None) or type(adapter).__name__
        provider = getattr(adapter, "provider", None) or "jetloop"
        step = f"{turn.session_id}.{turn.turn_id}.m{request.model_step}"
        if request.purpose != "answer":
            step += f".{request.purpose}"
        return self._span(
            f"chat {model}",
            turn,
            step,
            request.attempt,
            {
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": provider,
                "gen_ai.system": provider,
                "gen_ai.request.model": model,
                "jetloop.purpose": request.purpose,
            },
        )

    def tool_call(self, turn: TurnRecord, n: int, call: PlannedCall, attempt: int) -> Any:
        step = _call_step(turn, n, call)
        return self._span(
            f"execute_tool {call.tool}",
            turn,
            step,
            attempt,
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": call.tool,
                "gen_ai.tool.call.id": call.call_id,
                "jetloop.effect": call.effect,
                "jetloop.idempotency_key": call.idempotency_key,
            },
        )

    def wait_ended(
        self,
        turn: TurnRecord,
        n: int,
        call: PlannedCall,
        kind: str,
        started: float,
        attrs: dict[str, Any] | None = None,
    ) -> None:
        """A wait of a call (``approval``, ``answer``, ``timer``, ``child``), from when it
        began to now, made when it ends: the wait holds no process, so no span is open."""
        step = _call_step(turn, n, call)
        self._start(
            turn,
            _derived(f"wait:{step}.{kind}", 64),
            f"await_{kind} {call.tool}",
            context=self._parent(turn),
            start_time=int(min(started, time.time()) * 1e9),
            attributes={
                "jetloop.step_key": step,
                "jetloop.wait": kind,
                "gen_ai.tool.name": call.tool,
                "gen_ai.tool.call.id": call.call_id,
                "jetloop.idempotency_key": call.idempotency_key,
                **(attrs or {}),
            },
        ).end()

    def turn_ended(self, turn: TurnRecord) -> None:
        """The turn's own span, made when it ended: from when a worker accepted it (its
        record made; a record of an older release: its current model step's first attempt)
        to now, so it holds every step's span."""
        from opentelemetry.trace import (
            NonRecordingSpan,
            SpanContext,
            Status,
            StatusCode,
            TraceFlags,
        )

        given = parse_traceparent(turn.traceparent)
        context = None
        if given is not None:
            caller = SpanContext(given[0], given[1], is_remote=True, trace_flags=TraceFlags(1))
            context = self._trace.set_span_in_context(NonRecordingSpan(caller))
        started = turn.accepted_at or turn.first_attempt_at or time.time()
        span = self._start(
            turn,
            turn_span_id(turn),
            f"invoke_agent {turn.agent}",
            context=context,
            start_time=int(started * 1e9),
            attributes={
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.agent.name": turn.agent,
                "gen_ai.usage.input_tokens": turn.spent.input_tokens,
                "gen_ai.usage.output_tokens": turn.spent.output_tokens,
                "jetloop.request_id": turn.request_id,
                "jetloop.status": turn.status.value,
                "jetloop.model_calls": turn.spent.calls,
                "jetloop.cost_usd": turn.spent.cost_usd,
                "jetloop.lost_attempts": len(turn.lost),
            },
        )
        if turn.status != TurnStatus.COMPLETED:
            span.set_status(Status(StatusCode.ERROR, turn.error or turn.status.value))
        span.end()


def answered(span: Any, response: ModelResponse) -> None:
    """The model span's attributes from the answer (a no-op without a span)."""
    if span is None:
        return
    span.set_attributes(
        {
            "gen_ai.usage.input_tokens": int(response.usage.get("input_tokens", 0)),
            "gen_ai.usage.output_tokens": int(response.usage.get("output_tokens", 0)),
            "gen_ai.response.finish_reasons": ["tool_calls" if response.tool_calls else "stop"],
            "gen_ai.response.model": response.model or "",
            "jetloop.tool_calls": len(response.tool_calls),
        }
    )


def model_span(
    tracing: Tracing | None, turn: TurnRecord, request: ModelRequest, adapter: Any
) -> Any:
    """The span of a model call, or nothing when tracing is off."""
    if tracing is None:
        return contextlib.nullcontext(None)
    return tracing.model_call(turn, request, adapter)


def tool_span(
    tracing: Tracing | None, turn: TurnRecord, n: int, call: PlannedCall, attempt: int
) -> Any:
    """The span of a tool call, or nothing when tracing is off."""
    if tracing is None:
        return contextlib.nullcontext(None)
    return tracing.tool_call(turn, n, call, attempt)


def wait_ended(
    tracing: Tracing | None,
    turn: TurnRecord,
    n: int,
    call: PlannedCall,
    kind: str,
    started: float,
    attrs: dict[str, Any] | None = None,
) -> None:
    """The span of a wait that ended, or nothing when tracing is off."""
    if tracing is not None:
        tracing.wait_ended(turn, n, call, kind, started, attrs)


def _call_step(turn: TurnRecord, n: int, call: PlannedCall) -> str:
    """The key of a call's step (``StepMessage.step_key`` of its CallTool step)."""
    return f"{turn.session_id}.{turn.turn_id}.m{n}.c{call.index}"


def _fixed_ids() -> Any:
    """An id generator that hands out the ids jetloop derived for the span being started
    (``_NEXT``), and random ones otherwise."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class _FixedIds(RandomIdGenerator):
        def generate_span_id(self) -> int:
            fixed = _NEXT.get()
            return fixed[1] if fixed is not None else super().generate_span_id()

        def generate_trace_id(self) -> int:
            fixed = _NEXT.get()
            return fixed[0] if fixed is not None else super().generate_trace_id()

    return _FixedIds()
