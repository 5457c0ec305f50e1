"""The engine under a profiler: a worker run by pyinstrument while it serves 7-step turns.

``profile_engine`` starts one worker as ``python -m pyinstrument … -m jetloop.services.cli worker``
(stopped with SIGTERM, so it drains and pyinstrument writes its session), drives 7-step turns
of ``jetloop.tooling.bench.app`` through it, renders a text tree and pstats, and sums self time by
where it was spent: the event loop idle, asyncio, the nats-py client, pydantic, logging,
sealing, jetloop's own code. Nothing here changes the engine.
"""

from __future__ import annotations

import asyncio
import os
import pstats
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jetloop.tooling.bench.rig import APP, WORKER_START_SECONDS, Rig, run_batch, tag

JETLOOP_DIRS = ("/schemas/", "/streams/", "/consumers/", "/agents/", "/services/", "/demo/")
CATEGORIES = (
    ("event loop idle (selectors)", ("/selectors.py",)),
    ("asyncio machinery", ("/asyncio/",)),
    ("nats-py client", ("/nats/",)),
    ("pydantic (validate, dump)", ("/pydantic/", "/pydantic_core/")),
    ("logging (structlog, json)", ("/structlog/", "/logging/", "/json/")),
    ("sealing (hmac)", ("/hmac.py", "/hashlib.py")),
    ("jetloop code (self time)", JETLOOP_DIRS),
)


@dataclass
class ProfileResult:
    """Where the worker's time went while it ran 7-step turns (self time, sampled)."""

    text_path: str
    categories: dict[str, float]  # share of all samples
    busy_categories: dict[str, float]  # share of the non-idle samples
    top_self: list[tuple[str, float]]  # function, share of non-idle samples
    handlers: list[tuple[str, float]]  # jetloop handler, cumulative share of non-idle


IDLE = CATEGORIES[0][0]


def _where(filename: str, func: str) -> str:
    # pyinstrument names C functions ``<built-in>``; time in C called from Python code
    # (msgpack, pydantic-core) counts as self time of the Python caller.
    if filename == "<built-in>":
        if func == "epoll.poll":
            return IDLE
        if func.startswith("socket."):
            return "socket syscalls (send)"
        return "other built-ins"
    for name, marks in CATEGORIES:
        if any(m in filename for m in marks):
            return name
    return "other"


def summarise_profile(path: Path, text_path: Path) -> ProfileResult:
    """Self time by category, top functions by self time, handlers by cumulative time."""
    stats = pstats.Stats(str(path))
    table: dict[tuple[str, int, str], tuple[Any, ...]] = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in table.values()) or 1.0
    cats: dict[str, float] = {}
    for (filename, _, func), v in table.items():
        c = _where(filename, func)
        cats[c] = cats.get(c, 0.0) + v[2]
    idle = cats.get(IDLE, 0.0)
    busy = total - idle or 1.0
    top = sorted(
        (
            (f"{Path(fn).parent.name}/{Path(fn).name}:{line} {func}", v[2] / busy)
            for (fn, line, func), v in table.items()
            if _where(fn, func) != IDLE
        ),
        key=lambda kv: -kv[1],
    )[:15]
    handlers = sorted(
        (
            (f"{Path(fn).parent.name}/{Path(fn).name} {func}", v[3] / busy)
            for (fn, _, func), v in table.items()
            if "/consumers/" in fn and (func.startswith("on_") or func == "dispatch")
        ),
        key=lambda kv: -kv[1],
    )
    return ProfileResult(
        text_path=str(text_path),
        categories={k: v / total for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        busy_categories={
            k: v / busy for k, v in sorted(cats.items(), key=lambda kv: -kv[1]) if k != IDLE
        },
        top_self=top,
        handlers=handlers,
    )


def _spawn_profiled(r: Rig, session: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "pyinstrument",
        "-r",
        "pyisession",
        "-o",
        str(session),
        "-m",
        "jetloop.services.cli",
        "worker",
        "--app",
        APP,
        "--nats",
        r.server.url,
        "--id",
        "profiled",
    ]
    env = {**os.environ, **r.worker_env()}
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _render(session: Path, renderer: str, out: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pyinstrument",
            f"--load={session}",
            "-r",
            renderer,
            "-o",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )


async def profile_engine(
    r: Rig, out_dir: Path, sequential: int = 300, concurrent: int = 600, in_flight: int = 50
) -> ProfileResult:
    """Run the worker under pyinstrument while it serves 7-step turns (sequential, then
    ``in_flight`` at once); leave a text tree and pstats in ``out_dir``."""
    await asyncio.to_thread(out_dir.mkdir, parents=True, exist_ok=True)
    session, log = out_dir / "engine.pyisession", r.base / "profiled.log"
    proc = _spawn_profiled(r, session, log)
    try:
        deadline = time.monotonic() + WORKER_START_SECONDS
        while b'"worker.started"' not in await asyncio.to_thread(_read, log):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the profiled worker did not start: {_read(log)[-2000:]!r}")
            await asyncio.sleep(0.1)
        await run_batch(r.engine_turn, 5, 40, 10, tag("warm"))
        await run_batch(r.engine_turn, 5, sequential, 1, tag("ps"))
        await run_batch(r.engine_turn, 5, concurrent, in_flight, tag("pc"))
        await r.quiet()
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 120)
    text, stats = out_dir / "engine-profile.txt", out_dir / "engine.pstats"
    await asyncio.to_thread(_render, session, "text", text)
    await asyncio.to_thread(_render, session, "pstats", stats)
    await asyncio.to_thread(session.unlink)  # ~100 MB of raw samples; the two renders stay
    return summarise_profile(stats, text)


def _read(path: Path) -> bytes:
    return path.read_bytes() if path.exists() else b""
