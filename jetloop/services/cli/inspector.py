"""What ``jetloop inspect`` shows: what docs/tour.md's ``nats`` CLI commands would show, for
a machine where the ``nats`` CLI is not installed.

    jetloop inspect                     streams, consumers   (nats stream ls, consumer report)
    jetloop inspect --keys [PREFIX]     jl_state keys        (nats kv ls jl_state)
    jetloop inspect --kv KEY            one value, decoded   (nats kv get jl_state KEY)
    jetloop inspect --history KEY       every revision       (nats kv history jl_state KEY)
    jetloop inspect --dead              dead letters, reason (nats stream view JL_DEAD)
    jetloop inspect --stream S          last messages        (nats stream view S)
    jetloop inspect --stream S --seq N  one message, decoded (nats stream get S N)

Bodies are msgpack and are shown decoded; ``as_json`` prints JSON for machines. A key, a
stream or a message that does not exist is a ``Missing`` (one line for the person).
"""

from __future__ import annotations

import json
from typing import Any

import click
from nats.js import JetStreamContext, api
from nats.js.errors import KeyNotFoundError, NoKeysError, NotFoundError

from jetloop.schemas.codec import readable
from jetloop.streams import kvkeys
from jetloop.streams import topology as topo

# In text mode a body longer than this is cut (--json and --seq show it whole).
BODY_CHARS = 400


class Missing(LookupError):
    """The key, stream or message asked for is not there; the message says which."""


def _dumps(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, indent=indent, default=str, ensure_ascii=False)


def _cut(text: str) -> str:
    return text if len(text) <= BODY_CHARS else text[:BODY_CHARS] + " …"


def _table(rows: list[list[str]], right: set[int]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        click.echo("  ".join(cells).rstrip())


async def overview(js: JetStreamContext, as_json: bool, ephemeral: bool = False) -> None:
    """Every stream, and every consumer of every stream (per-agent durables included). In
    text, ephemeral consumers (clients' watchers, removed by the server once idle) are one
    count unless ``ephemeral``; JSON lists them all."""
    streams: list[dict[str, Any]] = []
    consumers: list[dict[str, Any]] = []
    for info in sorted(await js.streams_info(), key=lambda i: i.config.name or ""):
        name = info.config.name or ""
        streams.append(
            {
                "name": name,
                "messages": info.state.messages,
                "bytes": info.state.bytes,
                "consumers": info.state.consumer_count,
                "replicas": info.config.num_replicas,
            }
        )
        for ci in sorted(await js.consumers_info(name), key=lambda c: c.name):
            consumers.append(
                {
                    "name": ci.name,
                    "stream": name,
                    "durable": bool(ci.config.durable_name),
                    "pending": ci.num_pending,
                    "ack_pending": ci.num_ack_pending,
                    "redelivered": ci.num_redelivered,
                    "ack_wait": ci.config.ack_wait,
                }
            )
    if as_json:
        click.echo(_dumps({"streams": streams, "consumers": consumers}, indent=2))
        return
    rows = [["stream", "messages", "bytes", "consumers", "replicas"]]
    rows += [
        [s["name"], str(s["messages"]), str(s["bytes"]), str(s["consumers"]), f"R{s['replicas']}"]
        for s in streams
    ]
    _table(rows, right={1, 2, 3})
    click.echo("")
    rows = [["consumer", "stream", "pending", "ack pending", "redelivered"]]
    shown = [c for c in consumers if ephemeral or c["durable"]]
    rows += [
        [
            c["name"] + ("" if c["durable"] else " (ephemeral)"),
            c["stream"],
            str(c["pending"]),
            str(c["ack_pending"]),
            str(c["redelivered"]),
        ]
        for c in shown
    ]
    _table(rows, right={2, 3, 4})
    hidden = len(consumers) - len(shown)
    if hidden:
        click.echo(
            f"(and {hidden} ephemeral consumer(s): clients' watchers, removed by the server "
            "once idle; --all lists them)"
        )


async def _state(js: JetStreamContext) -> Any:
    return await js.key_value(topo.STATE_BUCKET)


async def keys(js: JetStreamContext, prefix: str, as_json: bool) -> None:
    """The state bucket's keys that start with ``prefix``, sorted."""
    kv = await _state(js)
    found = await kvkeys.keys(kv)
    names = sorted(k for k in found if k.startswith(prefix))
    if as_json:
        click.echo(_dumps({"bucket": topo.STATE_BUCKET, "prefix": prefix, "keys": names}))
        return
    for k in names:
        click.echo(k)
    what = f" starting with {prefix!r}" if prefix else ""
    click.echo(f"{len(names)} key(s){what} in {topo.STATE_BUCKET}", err=True)


def _no_key(key: str) -> Missing:
    return Missing(f"no key {key} in {topo.STATE_BUCKET} (list them: jetloop inspect --keys)")


async def value(js: JetStreamContext, key: str) -> None:
    """One key's current value, decoded."""
    kv = await _state(js)
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        raise _no_key(key) from None
    click.echo(
        _dumps(
            {"key": key, "revision": entry.revision, "value": readable(entry.value or b"")},
            indent=2,
        )
    )


async def history(js: JetStreamContext, key: str, as_json: bool) -> None:
    """Every revision the bucket still holds of one key, oldest first, decoded."""
    kv = await _state(js)
    try:
        entries = await kv.history(key)
    except (NoKeysError, KeyNotFoundError):
        raise _no_key(key) from None
    revs = [
        {
            "revision": e.revision,
            "operation": e.operation or "PUT",
            "created": e.created,
            "value": readable(e.value) if e.value else None,
        }
        for e in entries
    ]
    if as_json:
        click.echo(_dumps({"key": key, "revisions": revs}, indent=2))
        return
    click.echo(f"{key}: {len(revs)} revision(s)")
    for r in revs:
        click.echo(f"rev {r['revision']}  {r['operation']}  {r['created']}")
        if r["value"] is not None:
            click.echo(f"    {_cut(_dumps(r['value']))}")


async def _stream_info(js: JetStreamContext, stream: str) -> api.StreamInfo:
    try:
        return await js.stream_info(stream)
    except NotFoundError:
        raise Missing(f"no stream {stream} (list them: jetloop inspect)") from None


def _message(m: api.RawStreamMsg) -> dict[str, Any]:
    return {
        "seq": m.seq,
        "subject": m.subject,
        "time": m.time,
        "headers": dict(m.headers or {}),
        "body": readable(m.data or b""),
    }


async def message(js: JetStreamContext, stream: str, seq: int) -> None:
    """One stored message, headers and decoded body."""
    info = await _stream_info(js, stream)
    try:
        m = await js.get_msg(stream, seq)
    except NotFoundError:
        st = info.state
        raise Missing(
            f"no message {seq} in {stream} (it holds {st.messages} between "
            f"{st.first_seq} and {st.last_seq})"
        ) from None
    click.echo(_dumps(_message(m), indent=2))


async def messages(js: JetStreamContext, stream: str, last: int, as_json: bool) -> None:
    """A stream's last ``last`` messages with their headers, oldest first."""
    found = await _last(js, stream, last)
    if as_json:
        click.echo(_dumps({"stream": stream, "messages": [_message(m) for m in found]}))
        return
    click.echo(f"{stream}: the last {len(found)} message(s)")
    for m in found:
        hdrs = dict(m.headers or {})
        click.echo(f"#{m.seq}  {m.time}  {m.subject}")
        if hdrs:
            click.echo("    " + "  ".join(f"{k}: {v}" for k, v in sorted(hdrs.items())))
        click.echo(f"    {_cut(_dumps(readable(m.data or b'')))}")


async def dead_letters(js: JetStreamContext, last: int, as_json: bool) -> None:
    """The last dead letters: where each came from and why it was set aside."""
    found = await _last(js, topo.DEAD_STREAM, last)
    if as_json:
        click.echo(_dumps({"dead": [_message(m) for m in found]}))
        return
    if not found:
        click.echo("no dead letters")
        return
    for m in found:
        h = dict(m.headers or {})
        origin = f"{h.get('Jl-Dead-Stream', '?')} #{h.get('Jl-Dead-Sequence', '?')}"
        click.echo(f"#{m.seq}  {m.time}  from {origin} {h.get('Jl-Dead-Subject', m.subject)}")
        click.echo(f"    reason: {h.get('Jl-Dead-Reason', '(none given)')}")
        click.echo(f"    {_cut(_dumps(readable(m.data or b'')))}")


async def _last(js: JetStreamContext, stream: str, last: int) -> list[api.RawStreamMsg]:
    st = (await _stream_info(js, stream)).state
    if not st.messages or last <= 0:
        return []
    # A work queue deletes what was acked: when few are left, start at the first one.
    start = st.first_seq if st.messages <= last else max(st.first_seq, st.last_seq - last + 1)
    out: list[api.RawStreamMsg] = []
    seq = start
    while len(out) < last and seq <= st.last_seq:
        try:
            m = await js.get_msg(stream, seq=seq, subject=">", next=True)
        except NotFoundError:
            break
        if m.seq is None or m.seq > st.last_seq:
            break
        out.append(m)
        seq = m.seq + 1
    return out
