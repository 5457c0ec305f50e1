"""Commands for a session: ``send``, ``chat``, ``events``, ``snapshot``, ``turns``, ``turn``,
``sessions``, ``usage``."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import click

from jetloop.schemas import EventType

if TYPE_CHECKING:
    from jetloop.services.client import Client
    from jetloop.sessions.snapshot import SessionSnapshot

from jetloop.services.cli.main import (
    UNVERIFIED,
    VERIFIED_BY_WORKERS,
    _client_cmd,
    _describe,
    _echo_model,
    _note,
    _run,
    _session_exists,
    _settings,
    _unverified_reads,
    invoked_as,
    main,
    namespace_option,
)


@main.command()
@click.option("--agent", required=True)
@click.option("--session", "session_id", required=True)
@click.option("--request-id", help="idempotency key of this message (default: random)")
@click.option("--traceparent", help="W3C trace context whose span parents the turn's trace")
@click.option("--nats", "nats_url")
@namespace_option
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
    traceparent: str | None,
) -> None:
    """Send a message to a session, print its events and the answer."""
    from jetloop.schemas import validate_name
    from jetloop.schemas.errors import TurnFailed

    async def body(jl: Client) -> None:
        try:
            validate_name("session id", session_id)
            # Client.send tells a repeat from the turn record (state), not only from the
            # PubAck, whose id a work queue forgets: the note below holds after a restart.
            h = await jl.send(
                agent,
                session_id,
                text,
                request_id=request_id,
                traceparent=traceparent,
                will_wait=wait,
            )
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
        note = ""
        if h.status is not None:
            note = f" — duplicate request (the turn is {h.status.value}), showing it"
        elif h.duplicate:
            note = " — duplicate request (the first is still queued), showing its turn"
        click.echo(f"turn {h.turn_id} (request {h.request_id}){note}")
        if not wait:
            return
        # The turn's end is read from its record: unverified without the seal key.
        how = _unverified_reads(jl)

        async def follow() -> None:
            async for ev in jl.events(session_id, from_start=True):
                if ev.turn_id != h.turn_id or ev.type == EventType.MODEL_USAGE:
                    continue  # usage: `jetloop usage`, `jetloop events`
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
        _note(how, to_stderr=True)
        click.echo("")
        click.echo(res.text or "")

    _client_cmd(nats_url, body, timeout)


@main.command()
@click.argument("session_id")
@click.option("--nats", "nats_url")
@namespace_option
@click.option("--follow/--no-follow", default=True, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="one JSON object per event")
def events(session_id: str, nats_url: str | None, follow: bool, as_json: bool) -> None:
    """Tail a session's event log from its start."""

    async def body(jl: Client) -> None:
        if not await _session_exists(jl, session_id):
            raise click.ClickException(f"no session {session_id}")
        # --no-follow stops once the events stored when it started are shown.
        async for ev in jl.events(session_id, follow=follow):
            if as_json:
                click.echo(ev.model_dump_json())
                continue
            line = _describe(ev)
            if ev.type == EventType.TURN_ACCEPTED and ev.turn_id:
                # The user's words are the turn's (its record), not the event's: said here.
                said = await _request_text(jl, session_id, ev.turn_id)
                if said is not None:
                    line += f": {said}"
            click.echo(line)

    _client_cmd(nats_url, body)


# How much of a user's message `events` shows on its line.
SHOWN_TEXT = 200


async def _request_text(jl: Client, session_id: str, turn_id: str) -> str | None:
    """The user's message of a turn, quoted and cut to ``SHOWN_TEXT`` (None when the record
    cannot be read: gone, or not trusted)."""
    try:
        turn = await jl.turn(session_id, turn_id)
    except Exception:
        return None
    if turn is None:
        return None
    if turn.text_ref is not None and not turn.text:
        return f"({turn.text_ref.size} bytes, in the blob store)"
    text = turn.text if len(turn.text) <= SHOWN_TEXT else turn.text[:SHOWN_TEXT] + "…"
    return json.dumps(text, ensure_ascii=False)


@main.command()
@click.option("--agent", required=True)
@click.option("--resume", "session_id", help="a session to go on with (default: a new one)")
@click.option("--nats", "nats_url")
@namespace_option
def chat(agent: str, session_id: str | None, nats_url: str | None) -> None:
    """Talk to an agent: its text and tool calls as they happen, approvals with y/n,
    questions answered inline. Ctrl-D leaves (and says how to come back)."""
    import uuid

    from jetloop.schemas.errors import TurnFailed
    from jetloop.streams import topology as topo

    sid = session_id or f"chat-{uuid.uuid4().hex[:8]}"

    async def ask(prompt: str) -> str:
        return await asyncio.to_thread(input, prompt)

    async def body(jl: Client) -> None:
        click.echo(f"session {sid} with agent {agent} — Ctrl-D to leave")
        # Each turn's end is read from its record: unverified without the seal key.
        _note(_unverified_reads(jl), to_stderr=True)
        while True:
            try:
                text = await ask("you> ")
            except EOFError:
                click.echo(
                    f"\nbye. Come back with: {invoked_as()} chat --agent {agent} --resume {sid}"
                )
                return
            if not text.strip():
                continue
            try:
                h = await jl.send(agent, sid, text, will_wait=False)  # it follows the log
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
                    elif ev.type not in (
                        EventType.TURN_ACCEPTED,
                        EventType.TURN_STARTED,
                        EventType.MODEL_USAGE,
                    ):
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
@click.argument("session_id")
@click.option("--nats", "nats_url")
@namespace_option
@click.option("--history", "history_limit", default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def snapshot(session_id: str, nats_url: str | None, history_limit: int, as_json: bool) -> None:
    """Show a session: status, current turn, calls, waits, queue, history. Without the seal
    key it is read and verified by the workers, or, when none answers, read unverified:
    a line says which."""

    async def body(jl: Client) -> None:
        snap, how = await _read_snapshot(jl, session_id, history_limit)
        if snap is None:
            raise click.ClickException(f"no session {session_id}")
        _note(how, to_stderr=as_json)
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


async def _read_snapshot(
    jl: Client, session_id: str, history_limit: int
) -> tuple[SessionSnapshot | None, str | None]:
    """The snapshot, and how it was verified (``_note``): with the seal key here (None); else
    by the workers; else, when no worker answers, read directly and not verified."""
    from jetloop.schemas.errors import ControlError
    from jetloop.services.client import NO_WORKER

    if jl.sealer is not None or not jl.verify:
        return await jl.snapshot(session_id, history_limit=history_limit), _unverified_reads(jl)
    try:
        return await jl.snapshot(session_id, history_limit=history_limit), VERIFIED_BY_WORKERS
    except ControlError as exc:
        if exc.title != NO_WORKER:
            raise
    _unverified_reads(jl)
    snap = await jl.snapshot(session_id, history_limit=history_limit)
    return snap, f"{UNVERIFIED}; no worker answered to verify them"


@main.command()
@click.argument("session_id")
@click.option("--nats", "nats_url")
@namespace_option
@click.option("--limit", default=20, show_default=True, help="turns to show, newest first")
@click.option("--offset", default=0, show_default=True, help="newest turns to skip")
@click.option("--json", "as_json", is_flag=True)
def turns(session_id: str, nats_url: str | None, limit: int, offset: int, as_json: bool) -> None:
    """List a session's turns, newest first: request id, status, model step, calls, error."""

    async def body(jl: Client) -> None:
        how = _unverified_reads(jl)  # the workers serve no listing: unverified without the key
        page = await jl.turns(session_id, limit=limit, offset=offset)
        _note(how, to_stderr=as_json)
        if as_json:
            _echo_model(page)
            return
        shown = f"{offset + 1}-{offset + len(page.turns)}" if page.turns else "none"
        click.echo(f"session {session_id}: {page.total} turn(s), showing {shown}")
        for t in page.turns:
            err = f" — {t.error}" if t.error else ""
            click.echo(
                f"  {t.turn_id} request={t.request_id} {t.status.value} "
                f"model step {t.model_step}, {t.tool_calls_made} call(s){err}"
            )
        for u in page.untrusted:
            click.echo(f"  not trusted: {u}")

    _client_cmd(nats_url, body)


@main.command()
@click.argument("session_id")
@click.argument("turn_id")
@click.option("--nats", "nats_url")
@namespace_option
@click.option("--limit", default=100, show_default=True, help="calls to show at most")
@click.option("--json", "as_json", is_flag=True)
def turn(session_id: str, turn_id: str, nats_url: str | None, limit: int, as_json: bool) -> None:
    """Show one turn: its status and answer, and every call with its outcome."""

    async def body(jl: Client) -> None:
        how = _unverified_reads(jl)  # the workers serve no turn: unverified without the key
        detail = await jl.turn_calls(session_id, turn_id, limit=limit)
        _note(how, to_stderr=as_json)
        if as_json:
            _echo_model(detail)
            return
        t = detail.turn
        click.echo(
            f"turn {t.turn_id} (request {t.request_id}, agent {t.agent}): {t.status.value}, "
            f"model step {t.model_step}" + (f", error: {t.error}" if t.error else "")
        )
        for c in detail.calls:
            out = f" — {c.error}" if c.error else f" → {json.dumps(c.result)[:80]}"
            click.echo(f"  {c.call_id} {c.tool} [{c.effect}] {c.state} attempts={c.attempts}{out}")
        if detail.calls_more:
            click.echo(f"  … {detail.calls_more} more call(s): --limit")
        for u in detail.untrusted:
            click.echo(f"  not trusted: {u}")
        answer = await jl.answer_text(t)  # from jl_blobs when it was too large to keep inline
        if answer is not None:
            click.echo("")
            click.echo(answer)

    _client_cmd(nats_url, body)


@main.command()
@click.option("--q", "query", help="search session ids, agents and message texts")
@click.option("--status", help="idle, running, …")
@click.option("--agent")
@click.option("--limit", default=50, show_default=True)
@click.option(
    "--db",
    type=click.Path(),
    help="the read model (default the namespace's in the store directory: "
    "readmodel.sqlite for default)",
)
@namespace_option
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

    from jetloop.services.namespaces import readmodel_path
    from jetloop.services.readmodel.model import ReadModel, ReadModelMissing

    s = _settings()
    # Each namespace's read model is its own database (the projector of `up` writes one each).
    default_db = s.readmodel_db or s.store_dir / "readmodel.sqlite"
    path = Path(db) if db else readmodel_path(default_db, s.namespace)

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
@click.option("--session", "session_id", help="one session's calls (default: every session)")
@click.option("--turn", "turn_id", help="one turn's calls (with --session)")
@click.option("--agent", help="one agent's calls")
@click.option("--day", help="one UTC day's calls, YYYY-MM-DD")
@click.option(
    "--by",
    type=click.Choice(["turn", "session", "agent", "model", "day"]),
    default="session",
    show_default=True,
    help="what to total by",
)
@click.option("--nats", "nats_url")
@namespace_option
@click.option("--json", "as_json", is_flag=True)
def usage(
    session_id: str | None,
    turn_id: str | None,
    agent: str | None,
    day: str | None,
    by: str,
    nats_url: str | None,
    as_json: bool,
) -> None:
    """Tokens and cost of model calls, from the usage ledger: every call that got an
    answer, the attempts a crash made repeat included, totalled per turn, session, agent,
    model or day."""
    from jetloop.sessions.usage import totals, totals_json

    if turn_id is not None and session_id is None:
        raise click.UsageError("--turn needs --session")

    async def body(jl: Client) -> None:
        try:
            lines = await jl.usage(session_id)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
        lines = [
            line
            for line in lines
            if (turn_id is None or line.turn_id == turn_id)
            and (agent is None or line.agent == agent)
            and (day is None or line.day == day)
        ]
        if as_json:
            click.echo(json.dumps(totals_json(lines, by), indent=2))
            return
        if not lines:
            click.echo("no model calls recorded")
            return
        groups = totals(lines, by)
        width = max(len(by), *(len(g) for g in groups))
        click.echo(f"{by:<{width}}  {'calls':>6}  {'input':>10}  {'output':>10}  {'cost USD':>12}")
        for name, t in [*groups.items(), ("total", totals(lines)["all"])]:
            if t.unpriced_calls == t.calls:
                cost = f"{'–':>12}  (no price for {', '.join(t.models)})"
            elif t.unpriced_calls:
                # The priced calls' sum is not the cost: said as a part, with what is missing.
                cost = (
                    f"{t.priced_cost_usd:12.6f}  (priced calls only; {t.unpriced_calls} unpriced)"
                )
            else:
                cost = f"{t.priced_cost_usd:12.6f}"
            click.echo(
                f"{name:<{width}}  {t.calls:>6}  {t.input_tokens:>10}  "
                f"{t.output_tokens:>10}  {cost}"
            )

    _client_cmd(nats_url, body)
