"""The ``jetloop`` command."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Coroutine
from typing import Any

import click

from schemas import EventType
from services.logs import configure
from services.settings import Settings, SettingsError, load_settings


def _settings(**overrides: Any) -> Settings:
    clean = {k: v for k, v in overrides.items() if v is not None}
    try:
        return load_settings(**clean)
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from None


def _run(coro: Coroutine[Any, Any, None]) -> None:
    try:
        asyncio.run(coro)
    except KeyboardInterrupt:
        pass


@click.group()
@click.version_option(package_name="jetloop")
def main() -> None:
    """jetloop: durable execution of AI-agent turns on NATS JetStream."""


@main.command()
@click.option("--nats", "nats_url", help="use these NATS server(s) instead of starting one")
@click.option("--app", help="agents to serve, module:attr (default: the demo agent)")
@click.option("--store-dir", type=click.Path(), help="store directory (default .jetloop)")
@click.option("--port", "embedded_port", type=int, help="port of the embedded server")
def up(
    nats_url: str | None, app: str | None, store_dir: str | None, embedded_port: int | None
) -> None:
    """Start nats-server (embedded), the topology and a worker with the demo agent."""
    from services.up import run_up

    s = _settings(nats_url=nats_url, app=app, store_dir=store_dir, embedded_port=embedded_port)
    configure("console", s.log_level)
    _run(run_up(s, external=nats_url is not None))


@main.command()
@click.option("--app", help="agents to serve, module:attr")
@click.option("--nats", "nats_url", help="NATS server URL(s), comma-separated")
@click.option(
    "--pools",
    default="session,model,tool",
    show_default=True,
    help="which step pools this worker serves",
)
@click.option("--id", "worker_id", help="worker name in claims and logs")
def worker(app: str | None, nats_url: str | None, pools: str, worker_id: str | None) -> None:
    """Run a worker against existing NATS servers."""
    from agents import load_app
    from services.worker import Worker, default_worker_id

    s = _settings(app=app, nats_url=nats_url, worker_id=worker_id)
    wid = s.worker_id or default_worker_id()
    configure(s.log_format, s.log_level, worker=wid)
    try:
        loaded = load_app(s.app)
    except (ValueError, ImportError) as exc:
        raise click.ClickException(f"setting JETLOOP_APP / --app: {exc}") from None

    async def go() -> None:
        import signal

        w = Worker(
            s, loaded, pools=[p.strip() for p in pools.split(",") if p.strip()], worker_id=wid
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, w.stop_soon)
        await w.run()

    _run(go())


@main.command()
@click.option("--agent", required=True)
@click.option("--session", "session_id", required=True)
@click.option("--request-id", help="idempotency key of this message (default: random)")
@click.option("--nats", "nats_url")
@click.option("--wait/--no-wait", default=True, show_default=True)
@click.option("--timeout", default=120.0, show_default=True)
@click.argument("text")
def send(
    agent: str,
    session_id: str,
    request_id: str | None,
    nats_url: str | None,
    wait: bool,
    timeout: float,
    text: str,
) -> None:
    """Send a message to a session, print its events and the answer."""
    from services.client import Client, TurnFailed

    s = _settings(nats_url=nats_url)

    async def go() -> None:
        async with await Client.connect(s.nats_urls) as jl:
            try:
                h = await jl.send(agent, session_id, text, request_id=request_id)
            except ValueError as exc:
                raise click.ClickException(str(exc)) from None
            click.echo(
                f"turn {h.turn_id} (request {h.request_id})"
                + (" — duplicate request, showing the recorded turn" if h.duplicate else "")
            )
            if not wait:
                return

            async def follow() -> None:
                async for ev in jl.events(session_id, from_start=True):
                    if ev.turn_id != h.turn_id:
                        continue
                    click.echo(_describe(ev))
                    if ev.type in (EventType.TURN_COMPLETED, EventType.TURN_FAILED):
                        return

            try:
                await asyncio.wait_for(follow(), timeout)
                res = await jl.wait(h, timeout=timeout)
            except TurnFailed as exc:
                raise click.ClickException(str(exc)) from None
            except TimeoutError:
                raise click.ClickException(f"no answer within {timeout}s") from None
            click.echo("")
            click.echo(res.text or "")

    _run(go())


@main.command()
@click.argument("session_id")
@click.option("--nats", "nats_url")
@click.option("--follow/--no-follow", default=True, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="one JSON object per event")
def events(session_id: str, nats_url: str | None, follow: bool, as_json: bool) -> None:
    """Tail a session's event log from its start."""
    from services.client import Client

    s = _settings(nats_url=nats_url)

    async def go() -> None:
        async with await Client.connect(s.nats_urls) as jl:
            it = jl.events(session_id).__aiter__()
            while True:
                try:
                    ev = await asyncio.wait_for(it.__anext__(), None if follow else 2.0)
                except (TimeoutError, StopAsyncIteration):
                    return
                click.echo(ev.model_dump_json() if as_json else _describe(ev))

    _run(go())


@main.command()
@click.option("--nats", "nats_url")
def topology(nats_url: str | None) -> None:
    """Apply the topology (streams, consumers, buckets) to existing servers."""
    from streams import topology as topo
    from streams.connection import connect

    s = _settings(nats_url=nats_url)

    async def go() -> None:
        nc = await connect(s.nats_urls, "jetloop-topology")
        try:
            await topo.apply(nc.jetstream(), s.topology())
        finally:
            await nc.close()
        click.echo("topology applied")

    _run(go())


def _describe(ev: Any) -> str:
    d = ev.data
    match ev.type:
        case EventType.TURN_ACCEPTED:
            return "· accepted" + (" (queued behind the running turn)" if d.get("queued") else "")
        case EventType.TURN_STARTED:
            return "· started"
        case EventType.MODEL_ANSWERED:
            calls = ", ".join(f"{c['tool']}({json.dumps(c['args'])})" for c in d.get("calls", []))
            return f"· model step {d.get('model_step')}: {d.get('text') or ''} → {calls}"
        case EventType.CALL_OUTCOME:
            err = f": {d['error']}" if d.get("error") else ""
            return f"· {d.get('tool')} {d.get('state')}{err}"
        case EventType.TURN_COMPLETED:
            return "· completed"
        case EventType.TURN_FAILED:
            return f"· failed: {d.get('error')}"
        case EventType.CRASH_RESUMED:
            return f"· resumed after a lost attempt ({d.get('step')})"
    return f"· {ev.type}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
