"""An OTLP/HTTP trace receiver: ``POST /v1/traces`` with the real OTLP protobuf
(``ExportTraceServiceRequest``, gzip or not), decoded with ``opentelemetry-proto``; every
span is kept in ``spans`` as a plain ``Span``."""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from aiohttp import web


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    service: str
    attributes: dict[str, Any] = field(default_factory=dict)
    links: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    status: int = 0  # 0 unset, 1 ok, 2 error
    start_ns: int = 0
    end_ns: int = 0


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def __aenter__(self) -> Self:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def named(self, prefix: str) -> list[Span]:
        return [s for s in self.spans if s.name.startswith(prefix)]

    async def _traces(self, request: web.Request) -> web.Response:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if request.content_type != "application/x-protobuf":
            return web.Response(status=415, text="OTLP/HTTP protobuf only")
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        self.requests += 1
        for rs in export.resource_spans:
            service = str(_attrs(rs.resource.attributes).get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(
                        Span(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            service=service,
                            attributes=_attrs(s.attributes),
                            links=[
                                (ln.trace_id.hex(), ln.span_id.hex(), _attrs(ln.attributes))
                                for ln in s.links
                            ],
                            status=s.status.code,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                        )
                    )
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )
