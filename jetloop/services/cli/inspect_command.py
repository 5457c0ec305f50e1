"""``jetloop inspect``: the command; what it reads and prints is
``jetloop.services.cli.inspector``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from jetloop.services.client import Client

from jetloop.services.cli.main import _client_cmd, main, namespace_option


@main.command()
@click.option("--nats", "nats_url")
@namespace_option
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
@click.option("--all", "all_consumers", is_flag=True, help="list ephemeral consumers too")
def inspect(
    nats_url: str | None,
    as_json: bool,
    all_consumers: bool,
    keys_prefix: str | None,
    kv_key: str | None,
    history_key: str | None,
    dead: bool,
    stream: str | None,
    seq: int | None,
    last: int,
) -> None:
    """Streams and every consumer (pending, redelivered); or jl_state keys, a key's value
    or history, dead letters, a stream's messages (what docs/tour.md's `nats` commands show)."""
    from jetloop.services.cli import inspector

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
            await inspector.overview(js, as_json, all_consumers)

    _client_cmd(nats_url, body)
