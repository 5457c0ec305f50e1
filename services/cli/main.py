"""The ``jetloop`` command."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import click

from schemas import EventType
from services.logs import configure
from services.settings import Settings, SettingsError, load_settings

if TYPE_CHECKING:
    from services.client import Client


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
    # Commands that talk to NATS print only what matters; services reconfigure logging.
    configure("console", "warning")


@main.command()
@click.option("--nats", "nats_url", help="use these NATS server(s) instead of starting one")
@click.option("--app", help="agents to serve, module:attr (default: the demo agent)")
@click.option("--store-dir", type=click.Path(), help="store directory (default .jetloop)")
@click.option(
    "--nats-port", "--port", "embedded_port", type=int, help="port of the embedded server"
)
@click.option("--gateway-port", type=int, help="port of the gateway (HTTP API)")
def up(
    nats_url: str | None,
    app: str | None,
    store_dir: str | None,
    embedded_port: int | None,
    gateway_port: int | None,
) -> None:
    """Start nats-server (embedded), the topology, a worker with the demo agent, the gateway
    and the projector; restart any of them that fails."""
    from services.up import UpError, run_up

    s = _settings(
        nats_url=nats_url,
        app=app,
        store_dir=store_dir,
        embedded_port=embedded_port,
        gateway_port=gateway_port,
    )
    configure("console", s.log_level)
    try:
        _run(run_up(s, external=nats_url is not None))
    except UpError as exc:
        raise click.ClickException(str(exc)) from None


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
    from schemas import turn_id_for, validate_name
    from services.client import TurnFailed

    async def body(jl: Client) -> None:
        try:
            validate_name("session id", session_id)
            # JL_TURNS is a work queue: once a request ran, its message is gone and the
            # server forgets its id at a restart (or after the dedupe window), so the
            # PubAck alone may not say "duplicate". The turn record does: read it first.
            earlier = (
                await jl.turn(session_id, turn_id_for(session_id, request_id))
                if request_id
                else None
            )
            h = await jl.send(agent, session_id, text, request_id=request_id)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
        note = ""
        if earlier is not None:
            note = f" — duplicate request (the turn is {earlier.status.value}), showing it"
        elif h.duplicate:
            note = " — duplicate request (the first is still queued), showing its turn"
        click.echo(f"turn {h.turn_id} (request {h.request_id}){note}")
        if not wait:
            return

        async def follow() -> None:
            async for ev in jl.events(session_id, from_start=True):
                if ev.turn_id != h.turn_id:
                    continue
                click.echo(_describe(ev))
                if ev.type in (
                    EventType.TURN_COMPLETED,
                    EventType.TURN_FAILED,
                    EventType.TURN_CANCELLED,
                ):
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

    _client_cmd(nats_url, body, timeout)


@main.command()
@click.argument("session_id")
@click.option("--nats", "nats_url")
@click.option("--follow/--no-follow", default=True, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="one JSON object per event")
def events(session_id: str, nats_url: str | None, follow: bool, as_json: bool) -> None:
    """Tail a session's event log from its start."""

    async def body(jl: Client) -> None:
        if not await _session_exists(jl, session_id):
            raise click.ClickException(f"no session {session_id}")
        it = jl.events(session_id).__aiter__()
        while True:
            try:
                ev = await asyncio.wait_for(it.__anext__(), None if follow else 2.0)
            except (TimeoutError, StopAsyncIteration):
                return
            click.echo(ev.model_dump_json() if as_json else _describe(ev))

    _client_cmd(nats_url, body)


async def _session_exists(jl: Client, session_id: str) -> bool:
    """A session exists once it has a state record (``session.<id>``) or an event."""
    from nats.js.errors import KeyNotFoundError, NotFoundError

    from schemas import validate_name
    from streams import topology as topo
    from streams.state import session_key

    try:
        validate_name("session id", session_id)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    kv = await jl.js.key_value(topo.STATE_BUCKET)
    try:
        await kv.get(session_key(session_id))
        return True
    except KeyNotFoundError:
        pass
    try:
        await jl.js.get_msg(
            topo.EVENTS_STREAM, seq=1, subject=topo.event_subject(session_id, ">"), next=True
        )
    except NotFoundError:
        return False
    return True


# How long a client command waits for NATS before it says so in one line: the first
# connect, and a reconnect after the server went away (at most --timeout where it has one).
PATIENCE = 5.0

Body = Callable[["Client"], Coroutine[Any, Any, None]]


def _client_cmd(nats_url: str | None, body: Body, timeout: float | None = None) -> None:
    """Run ``body(client)`` with a connected client. NATS that cannot be reached or is lost
    (after ``PATIENCE`` seconds, or ``timeout`` if shorter), a NATS error and a refused
    control request each end the command with one line and exit status 1."""
    s = _settings(nats_url=nats_url)
    _run(_with_client(s.nats_urls, body, timeout))


async def _with_client(urls: list[str], body: Body, timeout: float | None) -> None:
    from nats.errors import ConnectionClosedError, NoServersError
    from nats.errors import Error as NatsError

    from consumers.control import ControlError
    from services.cli.inspector import Missing
    from services.client import Client

    where = ", ".join(urls)
    lost = asyncio.Event()

    async def on_closed() -> None:
        lost.set()

    patience = min(PATIENCE, timeout) if timeout else PATIENCE
    try:
        jl = await Client.connect(urls, give_up_after=patience, on_closed=on_closed)
    except (NoServersError, TimeoutError, OSError):
        raise click.ClickException(
            f"cannot reach NATS at {where} (is 'jetloop up' running?)"
        ) from None
    except NatsError as exc:
        raise click.ClickException(f"NATS at {where} refused the connection: {exc}") from None
    async with jl:
        work = asyncio.create_task(body(jl))
        gone = asyncio.create_task(lost.wait())
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            work.cancel()  # the connection is gone (or we were interrupted)
            await asyncio.wait((work,))
        try:
            work.result()
        except (asyncio.CancelledError, ConnectionClosedError):
            raise click.ClickException(
                f"lost the connection to NATS at {where} (is 'jetloop up' running?)"
            ) from None
        except ControlError as exc:
            raise click.ClickException(str(exc)) from None
        except Missing as exc:
            raise click.ClickException(str(exc)) from None
        except (NatsError, TimeoutError) as exc:
            raise click.ClickException(f"NATS at {where}: {_nats_error(exc)}") from None


def _nats_error(exc: BaseException) -> str:
    """A NATS error in a few words, with what to do where that is known."""
    from nats.errors import NoRespondersError
    from nats.js.errors import NotFoundError, ServiceUnavailableError

    if isinstance(exc, NotFoundError):
        return (
            f"{exc.description or 'not found'} (is the topology applied? "
            "`jetloop up` or `jetloop topology` applies it)"
        )
    if isinstance(exc, NoRespondersError | ServiceUnavailableError):
        return "JetStream did not answer (is JetStream enabled on that server?)"
    if isinstance(exc, TimeoutError):
        return "no answer in time (the server is busy or electing a leader: try again)"
    return str(exc) or type(exc).__name__


def _echo_model(model: Any) -> None:
    click.echo(json.dumps(model.model_dump(mode="json", exclude_none=True), indent=2))


@main.command()
@click.argument("session_id")
@click.option("--nats", "nats_url")
@click.option("--history", "history_limit", default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def snapshot(session_id: str, nats_url: str | None, history_limit: int, as_json: bool) -> None:
    """Show a session: status, current turn, calls, waits, queue, history."""

    async def body(jl: Any) -> None:
        snap = await jl.snapshot(session_id, history_limit=history_limit)
        if snap is None:
            raise click.ClickException(f"no session {session_id}")
        if as_json:
            _echo_model(snap)
            return
        click.echo(
            f"session {snap.session_id} (agent {snap.agent}): {snap.status}, "
            f"{snap.turns_done} turn(s) done"
        )
        if snap.turn is not None:
            t = snap.turn
            click.echo(
                f"turn {t.turn_id}: {t.status.value}, model step {t.model_step}"
                + (f", error: {t.error}" if t.error else "")
            )
        for c in snap.calls:
            err = f" — {c.error}" if c.error else ""
            click.echo(
                f"  call {c.call_key} {c.tool} [{c.effect}] {c.state} attempts={c.attempts}{err}"
            )
        for a in snap.approvals:
            click.echo(f"  approval {a.approval_id}: {a.tool}({json.dumps(a.args)}) pending")
        for q in snap.questions:
            click.echo(f"  question {q.question_id}: {q.question}")
        for q2 in snap.queued:
            click.echo(f"  queued {q2.turn_id}: {q2.text[:60]}")

    _client_cmd(nats_url, body)


@main.command()
@click.argument("session_id")
@click.argument("approval_id")
@click.option("--reject", is_flag=True, help="reject instead of approve")
@click.option("--reason")
@click.option("--by", default="cli", show_default=True)
@click.option("--nats", "nats_url")
def approve(
    session_id: str,
    approval_id: str,
    reject: bool,
    reason: str | None,
    by: str,
    nats_url: str | None,
) -> None:
    """Approve (or --reject) a call held for approval."""

    async def body(jl: Any) -> None:
        fn = jl.reject if reject else jl.approve
        ap = await fn(session_id, approval_id, by=by, reason=reason)
        click.echo(f"{ap.approval_id}: {ap.status.value} by {ap.decided_by}")

    _client_cmd(nats_url, body)


@main.command()
@click.argument("session_id")
@click.argument("question_id")
@click.argument("text")
@click.option("--by", default="cli", show_default=True)
@click.option("--nats", "nats_url")
def answer(session_id: str, question_id: str, text: str, by: str, nats_url: str | None) -> None:
    """Answer a question the model asked."""

    async def body(jl: Any) -> None:
        q = await jl.answer(session_id, question_id, text, by=by)
        click.echo(f"{q.question_id}: answered {q.answer!r} by {q.answered_by}")

    _client_cmd(nats_url, body)


@main.command()
@click.argument("session_id")
@click.option("--turn", "turn_id", help="a turn id (default: the running turn)")
@click.option("--by", default="cli", show_default=True)
@click.option("--nats", "nats_url")
def cancel(session_id: str, turn_id: str | None, by: str, nats_url: str | None) -> None:
    """Cancel a session's running turn."""

    async def body(jl: Any) -> None:
        t = await jl.cancel(session_id, turn_id, by=by)
        click.echo(f"turn {t.turn_id}: {t.status.value}")

    _client_cmd(nats_url, body)


@main.command()
@click.argument("call_key")
@click.option("--succeeded/--failed", required=True)
@click.option("--result", help="JSON result (with --succeeded)")
@click.option("--error", help="error text (with --failed)")
@click.option("--by", default="cli", show_default=True)
@click.option("--nats", "nats_url")
def reconcile(
    call_key: str,
    succeeded: bool,
    result: str | None,
    error: str | None,
    by: str,
    nats_url: str | None,
) -> None:
    """Settle an outcome_unknown call as succeeded or failed."""
    try:
        value = json.loads(result) if result else None
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--result") from None

    async def body(jl: Any) -> None:
        rec = await jl.reconcile(call_key, succeeded, by=by, result=value, error=error)
        click.echo(f"{rec.key}: {rec.state.value} (reconciled by {rec.reconciled_by})")

    _client_cmd(nats_url, body)


@main.command()
@click.option("--nats", "nats_url")
@click.option("--json", "as_json", is_flag=True, help="JSON, for machines")
@click.option(
    "--keys",
    "keys_prefix",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="[PREFIX]",
    help="list the jl_state keys (those starting with PREFIX)",
)
@click.option("--kv", "kv_key", metavar="KEY", help="decode one jl_state key (e.g. session.s1)")
@click.option(
    "--history", "history_key", metavar="KEY", help="every revision of one jl_state key, decoded"
)
@click.option("--dead", is_flag=True, help="the last dead letters, with their Jl-Dead-Reason")
@click.option("--stream", help="a stream's last messages with headers (one, with --seq)")
@click.option("--seq", type=int, help="with --stream: decode the message at this sequence")
@click.option(
    "--last", default=10, show_default=True, help="how many messages --stream and --dead show"
)
def inspect(
    nats_url: str | None,
    as_json: bool,
    keys_prefix: str | None,
    kv_key: str | None,
    history_key: str | None,
    dead: bool,
    stream: str | None,
    seq: int | None,
    last: int,
) -> None:
    """Streams and every consumer (pending, redelivered); or jl_state keys, a key's value
    or history, dead letters, a stream's messages (what the README's `nats` commands show)."""
    from services.cli import inspector

    given = {
        "--keys": keys_prefix is not None,
        "--kv": kv_key is not None,
        "--history": history_key is not None,
        "--dead": dead,
        "--stream": stream is not None,
    }
    chosen = [name for name, on in given.items() if on]
    if len(chosen) > 1:
        raise click.UsageError(f"choose one of {', '.join(chosen)}")
    if seq is not None and stream is None:
        raise click.UsageError("--seq needs --stream")

    async def body(jl: Client) -> None:
        js = jl.js
        if keys_prefix is not None:
            await inspector.keys(js, keys_prefix, as_json)
        elif kv_key is not None:
            await inspector.value(js, kv_key)
        elif history_key is not None:
            await inspector.history(js, history_key, as_json)
        elif dead:
            await inspector.dead_letters(js, last, as_json)
        elif stream is not None and seq is not None:
            await inspector.message(js, stream, seq)
        elif stream is not None:
            await inspector.messages(js, stream, last, as_json)
        else:
            await inspector.overview(js, as_json)

    _client_cmd(nats_url, body)


@main.command()
@click.option("--agent", required=True)
@click.option("--resume", "session_id", help="a session to go on with (default: a new one)")
@click.option("--nats", "nats_url")
def chat(agent: str, session_id: str | None, nats_url: str | None) -> None:
    """Talk to an agent: its text and tool calls as they happen, approvals with y/n,
    questions answered inline. Ctrl-D leaves (and says how to come back)."""
    import uuid

    from services.client import TurnFailed
    from streams import topology as topo

    sid = session_id or f"chat-{uuid.uuid4().hex[:8]}"

    async def ask(prompt: str) -> str:
        return await asyncio.to_thread(input, prompt)

    async def body(jl: Client) -> None:
        click.echo(f"session {sid} with agent {agent} — Ctrl-D to leave")
        while True:
            try:
                text = await ask("you> ")
            except EOFError:
                click.echo(f"\nbye. Come back with: jetloop chat --agent {agent} --resume {sid}")
                return
            if not text.strip():
                continue
            try:
                h = await jl.send(agent, sid, text)
            except ValueError as exc:
                raise click.ClickException(str(exc)) from None
            live = await jl.nc.subscribe(topo.live_subject(sid, h.turn_id), cb=_print_delta)
            try:
                async for ev in jl.events(sid):
                    if ev.turn_id != h.turn_id:
                        continue
                    if ev.type == EventType.APPROVAL_REQUESTED:
                        d = ev.data
                        yes = (
                            (await ask(f"  approve {d['tool']}({json.dumps(d['args'])})? [y/n] "))
                            .strip()
                            .lower()
                            .startswith("y")
                        )
                        if yes:
                            await jl.approve(sid, d["approval_id"], by="chat")
                        else:
                            await jl.reject(
                                sid, d["approval_id"], by="chat", reason="declined in chat"
                            )
                    elif ev.type == EventType.QUESTION_ASKED:
                        answer = await ask(f"  {ev.data['question']} > ")
                        await jl.answer(sid, ev.data["question_id"], answer, by="chat")
                    elif ev.type in (EventType.TIMER_SET, EventType.TASK_STARTED):
                        click.echo(_describe(ev) + " … waiting")
                    elif ev.type not in (EventType.TURN_ACCEPTED, EventType.TURN_STARTED):
                        click.echo(_describe(ev))
                    if ev.type in (
                        EventType.TURN_COMPLETED,
                        EventType.TURN_FAILED,
                        EventType.TURN_CANCELLED,
                    ):
                        break
                try:
                    res = await jl.wait(h, timeout=30)
                    click.echo(f"agent> {res.text}")
                except TurnFailed as exc:
                    click.echo(f"agent> (the turn {exc.turn.status.value}: {exc.turn.error})")
            finally:
                await live.unsubscribe()

    _client_cmd(nats_url, body)


async def _print_delta(msg: Any) -> None:
    click.echo(msg.data.decode(errors="replace"), nl=False)


@main.command()
@click.option("--nats", "nats_url")
@click.option("--replicas", type=int, help="set the replica count of every stream (R3: 3)")
@click.option(
    "--app",
    help="also declare this app's agents (module:attr), so messages to them are accepted "
    "and wait before its first worker runs",
)
def topology(nats_url: str | None, replicas: int | None, app: str | None) -> None:
    """Apply the topology (streams, consumers, buckets) to existing servers."""
    from agents import load_app
    from streams import topology as topo

    s = _settings(nats_url=nats_url, replicas=replicas)
    try:
        agents = sorted(load_app(app).agents) if app else []
    except (ValueError, ImportError) as exc:
        raise click.ClickException(f"--app: {exc}") from None

    async def body(jl: Client) -> None:
        await topo.apply(jl.js, s.topology(), set_replicas=replicas is not None)
        if agents:
            await (await jl.registry()).declare(agents, "jetloop topology")
        click.echo(
            "topology applied" + (f"; agents declared: {', '.join(agents)}" if agents else "")
        )

    _client_cmd(nats_url, body)


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
        case EventType.APPROVAL_REQUESTED:
            return (
                f"· {d.get('tool')} waits for approval: "
                f"jetloop approve {ev.session_id} {d.get('approval_id')}"
            )
        case EventType.APPROVAL_DECIDED:
            return f"· approval {d.get('status')} by {d.get('by')}"
        case EventType.QUESTION_ASKED:
            return (
                f"· question: {d.get('question')} — "
                f"jetloop answer {ev.session_id} {d.get('question_id')} '…'"
            )
        case EventType.QUESTION_ANSWERED:
            return f"· answered by {d.get('by')}: {d.get('answer')}"
        case EventType.TIMER_SET:
            return f"· timer set for {d.get('at')}"
        case EventType.TIMER_FIRED:
            return "· timer fired"
        case EventType.TASK_STARTED:
            return f"· task started: {d.get('handle')}"
        case EventType.TURN_CANCELLED:
            return f"· cancelled by {d.get('by')}"
    return f"· {ev.type}"


@main.command()
@click.option("--q", "query", help="search session ids, agents and message texts")
@click.option("--status", help="idle, running, …")
@click.option("--agent")
@click.option("--limit", default=50, show_default=True)
@click.option(
    "--db", type=click.Path(), help="the read model (default <store dir>/readmodel.sqlite)"
)
@click.option("--json", "as_json", is_flag=True)
def sessions(
    query: str | None,
    status: str | None,
    agent: str | None,
    limit: int,
    db: str | None,
    as_json: bool,
) -> None:
    """List and search sessions (from the projector's read model)."""
    from pathlib import Path

    from services.readmodel.model import ReadModel, ReadModelMissing

    s = _settings()
    path = Path(db) if db else (s.readmodel_db or s.store_dir / "readmodel.sqlite")

    async def go() -> None:
        try:
            rm = await ReadModel.open(path, readonly=True)
        except ReadModelMissing:
            raise click.ClickException(
                f"no read model at {path}: run `jetloop up` or `jetloop projector`"
            ) from None
        async with rm:
            page = await rm.list_sessions(query, status, agent, limit)
        if as_json:
            click.echo(json.dumps({"total": page.total, "sessions": page.sessions}, default=str))
            return
        click.echo(f"{page.total} session(s)")
        for row in page.sessions:
            click.echo(
                f"  {row.get('session_id')}  agent={row.get('agent')}  "
                f"status={row.get('status')}  turns={row.get('turns_total')}"
            )

    _run(go())


@main.command()
@click.option(
    "--mode",
    "modes",
    multiple=True,
    default=("worker_kill",),
    type=click.Choice(["worker_kill", "server_restart", "takeover", "mixed"]),
)
@click.option("--rounds", type=int, help="default JETLOOP_TRIALS (10)")
@click.option("--seed", type=int, help="default JETLOOP_KILL_SEED (random)")
@click.option("--json", "out_json", type=click.Path(dir_okay=False))
@click.option("--keep", type=click.Path(file_okay=False), help="keep logs and stores here")
def trials(
    modes: tuple[str, ...],
    rounds: int | None,
    seed: int | None,
    out_json: str | None,
    keep: str | None,
) -> None:
    """Kill trials: random SIGKILLs of workers, servers or leaders, judged from state."""
    from pathlib import Path

    from tooling.trials.run import main as run

    sys.exit(run(modes, rounds, seed, out_json, Path(keep) if keep else None))


@main.command()
@click.argument(
    "which",
    nargs=-1,
    type=click.Choice(["overhead", "throughput", "history", "waiting", "profile", "peer"]),
)
@click.option(
    "--quick", is_flag=True, help="small samples: a smoke run (about 30 s on 2 idle cores)"
)
@click.option("--waiting-sessions", type=int)
@click.option("--json", "out_json", type=click.Path(dir_okay=False))
@click.option("--keep", type=click.Path(file_okay=False))
def bench(
    which: tuple[str, ...],
    quick: bool,
    waiting_sessions: int | None,
    out_json: str | None,
    keep: str | None,
) -> None:
    """Benchmarks, each as a ratio against a baseline measured in the same run: the raw
    JetStream floor, or (``peer``, needs ``pip install 'jetloop[peer]'``) DBOS Transact."""
    from pathlib import Path

    from tooling.bench.run import main as run

    sys.exit(
        run(
            which or ("overhead", "throughput", "history"),
            quick,
            out_json,
            Path(keep) if keep else None,
            waiting_sessions,
        )
    )


def _add_service_commands() -> None:
    from services.gateway.app import gateway_command
    from services.readmodel.projector import projector_command

    main.add_command(gateway_command)
    main.add_command(projector_command)


_add_service_commands()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
