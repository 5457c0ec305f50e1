"""Crash-test your own agent from Python (a pytest suite, a notebook): one call, a report.

    from jetloop.testing import crash_test

    def test_my_agent_survives_crashes():
        report = crash_test("myapp:app", ["open a ticket for the printer", "close it"])
        assert report.ok, report.failures

``crash_test`` starts a nats-server of its own (a temporary store), real worker processes of
the app ``module:attr`` with every tool watched, sends the messages to one session, finds
every step boundary the conversation reaches, then kills the worker at each of them (and at
``rounds`` random moments) and judges the whole from state and a ledger of tool invocations:
lost turns, calls run more than once, ``outcome_unknown``, answers delivered twice.
docs/crash-testing.md has the report's fields and the model script's shape.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from pathlib import Path

from jetloop.tooling.crashtest.judge import CrashReport, ToolReport, format_report
from jetloop.tooling.crashtest.run import crash_test as crash_test_async
from jetloop.tooling.crashtest.script import Message, messages_of

__all__ = [
    "CrashReport",
    "Message",
    "ToolReport",
    "crash_test",
    "crash_test_async",
    "format_report",
]


def crash_test(
    app: str,
    messages: Sequence[str] | Sequence[dict[str, str]] | Sequence[Message],
    *,
    model_script: str | Path | None = None,
    mode: str = "worker_kill",
    rounds: int = 0,
    seed: int | None = None,
    quick: bool = False,
    vendor_dedupes: Sequence[str] = (),
    pure: Sequence[str] = (),
    work_dir: str | Path | None = None,
) -> CrashReport:
    """Crash-test ``app`` on ``messages`` (texts for an app with one agent, else
    ``{"agent", "text"}`` maps) and return the report; ``report.ok`` is the verdict.

    ``model_script``: a JSON file of scripted model replies (no network, no key);
    ``mode``: ``worker_kill`` or ``server_restart``; ``rounds``: random kills besides the
    systematic ones; ``quick``: the first boundary of each kind only; ``vendor_dedupes``:
    the ``IDEMPOTENT_WRITE`` tools whose vendor dedupes on the idempotency key (their repeats
    pass); ``pure``: the ``READ`` tools you vouch change nothing (their repeats are not
    warned of, ``report.warnings``); ``work_dir``: keep logs, store and ledger there.
    Callable from a running event loop too (it then runs on a thread of its own);
    ``crash_test_async`` is the coroutine.
    """
    coro = crash_test_async(
        app,
        messages_of(list(messages)),  # type: ignore[arg-type]
        model_script=Path(model_script) if model_script is not None else None,
        mode=mode,
        rounds=rounds,
        seed=seed,
        quick=quick,
        vendor_dedupes=vendor_dedupes,
        pure=pure,
        work_dir=Path(work_dir) if work_dir is not None else None,
    )
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
