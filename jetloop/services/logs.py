"""structlog set-up: JSON lines for services, readable console lines for ``jetloop up``.

Handlers bind session, turn, step and call ids (``jetloop.consumers.logcontext``), so every
line a step writes carries them.

aiohttp's server logs a request it cannot parse (and any error outside a handler) through
the standard ``aiohttp.server`` logger, with a traceback whose message quotes the request's
raw bytes: a bearer token on the offending line would reach the log. ``configure`` puts a
filter there that turns each such record into one ``http.bad_request`` line naming the
error's class and status, and drops the record: no request byte is logged.
"""

from __future__ import annotations

import logging
import sys

import structlog
from aiohttp.http_exceptions import HttpProcessingError

from jetloop.consumers.logcontext import merge_step

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure(fmt: str = "json", level: str = "info", worker: str | None = None) -> None:
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        merge_step,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if worker:
        processors.insert(0, _add_worker(worker))
    if fmt == "json":
        processors += [
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(),
        ]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=False,
    )
    server = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, WithoutRequestBytes) for f in server.filters):
        server.addFilter(WithoutRequestBytes())


class WithoutRequestBytes(logging.Filter):
    """Say what aiohttp's server failed on without its exception's text (which may quote the
    request: headers, a token); the record itself is never emitted."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            # A plain message of aiohttp's: none of them quotes a request.
            return True
        frame = exc.__traceback__
        while frame is not None and frame.tb_next is not None:
            frame = frame.tb_next
        status = exc.code if isinstance(exc, HttpProcessingError) else None
        log = structlog.get_logger("aiohttp.server")
        # A request that does not parse is the client's fault; anything else is ours.
        emit = log.info if isinstance(exc, HttpProcessingError) else log.error
        emit(
            "http.bad_request" if status is not None else "http.server_error",
            # Both messages aiohttp logs this way start "Error handling request from <address>".
            remote=record.args[0] if isinstance(record.args, tuple) and record.args else None,
            error=type(exc).__name__,
            status=status,
            where=f"{frame.tb_frame.f_code.co_filename}:{frame.tb_lineno}" if frame else None,
            hint="the request's bytes are not logged",
        )
        return False


def _add_worker(worker: str) -> structlog.types.Processor:
    def add(_: object, __: str, event: structlog.types.EventDict) -> structlog.types.EventDict:
        event.setdefault("worker", worker)
        return event

    return add
