"""structlog set-up: JSON lines for services, readable console lines for ``jetloop up``.

Handlers bind session, turn, step and call ids (``jetloop.consumers.logcontext``), so every
line a step writes carries them.
"""

from __future__ import annotations

import logging
import sys

import structlog

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


def _add_worker(worker: str) -> structlog.types.Processor:
    def add(_: object, __: str, event: structlog.types.EventDict) -> structlog.types.EventDict:
        event.setdefault("worker", worker)
        return event

    return add
