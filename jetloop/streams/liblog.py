"""Logging as a library: structlog when the program set it up, else the standard ``logging``.

jetloop's processes (worker, gateway, ``jetloop up``, the CLI) configure structlog
(``jetloop.services.logs``). A program that only imports jetloop and drives it with the client has
not, and structlog's default prints every line on stdout — the program's own output. So
this logger asks at each call: structlog once it is configured (by jetloop or by the
program), otherwise the standard library's logger of the same name (``jetloop.…``). That
one has a ``NullHandler`` (the logging HOWTO's advice to libraries), so nothing is printed
unless the program configures ``logging`` itself, and then the lines go where it says.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

logging.getLogger("jetloop").addHandler(logging.NullHandler())


class LibraryLogger:
    """``debug`` / ``info`` / ``warning`` / ``error`` (event, **fields), as structlog's."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._structlog = structlog.get_logger(name)
        self._stdlib = logging.getLogger(name)

    def _emit(self, level: int, event: str, fields: dict[str, Any]) -> None:
        if structlog.is_configured():
            self._structlog.log(level, event, **fields)
        elif self._stdlib.isEnabledFor(level):
            text = " ".join([event, *(f"{k}={v!r}" for k, v in fields.items())])
            self._stdlib.log(
                level, "%s", text, extra={"jetloop_event": event, "jetloop_fields": fields}
            )

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, event, fields)
