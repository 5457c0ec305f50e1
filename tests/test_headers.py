"""The header parser the worker's connection uses reads every block as nats-py does."""

from __future__ import annotations

import random

import pytest
from nats.aio.client import Client
from nats.errors import BadHeaderError, BadSubjectError

from jetloop.streams.connection import SizedClient, header_block, message_size
from jetloop.streams.headers import parse_header_lines

BLOCKS = [
    b"Nats-Msg-Id: s1.t1.m0.c3\r\nJl-Kind: call_tool\r\nJl-Session: s1\r\n\r\n",
    b"Nats-Stream: KV_jl_state\r\nNats-Subject: $KV.jl_state.turn.s.t\r\nNats-Sequence: 42\r\n"
    b"Nats-Time-Stamp: 2026-11-30T12:00:00.1Z\r\nKV-Operation: DEL\r\n\r\n",
    b"Name:Value\r\nTabbed:\tvalue \r\n  Padded  :  x  \r\n",
    b"Bad Name: skipped\r\nno colon here\r\n: empty name\r\n\r\n",
    "Ünïcode-Name: x\r\nOk: välue\r\n".encode(),
    b"Broken-Utf8: \xff\xfe\r\nSep\x1cName: y\r\nDup: 1\r\nDup: 2\r\n",
    b"",
    b"\r\n\r\n",
]


def test_the_same_headers_as_nats_py_for_every_block() -> None:
    for raw in BLOCKS:
        assert parse_header_lines(raw) == Client._parse_header_lines(raw), raw
        # Twice: the second read goes through the remembered names.
        assert parse_header_lines(raw) == Client._parse_header_lines(raw), raw


def test_the_same_headers_for_random_blocks() -> None:
    rng = random.Random(7)
    alphabet = b"ab-: \t\r\n\x1c\xc3\xa9\xff"
    for _ in range(3000):
        raw = bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        assert parse_header_lines(raw) == Client._parse_header_lines(raw), raw


def test_the_worker_connection_parses_with_it() -> None:
    assert SizedClient._parse_header_lines is parse_header_lines


async def _sent(client: Client, headers: dict[str, str] | None, reply: str = "_INBOX.x.1") -> bytes:
    """The command a client queues to publish ``headers`` (no server: captured, not sent)."""
    client._pending = []
    sent: list[bytes] = []

    async def capture(cmd: bytes, priority: bool = False) -> None:
        sent.append(cmd)

    client._send_command = capture  # type: ignore[method-assign]
    client._status = Client.CONNECTED
    client._flush_queue = None
    client._max_payload = 1 << 20
    await client.publish("s.a", b"body", reply=reply, headers=headers)
    # nats-py queues through _send_command; SizedClient appends to the same pending list.
    return b"".join(sent) + b"".join(client._pending)


async def test_a_publish_with_headers_is_the_command_nats_py_sends() -> None:
    rng = random.Random(11)
    names = ["Nats-Msg-Id", " Padded ", "", "Jl-Kind", "x", "Nats-Expected-Last-Subject-Sequence"]
    values = ["v", " spaced ", "new\r\nline", "", "ünï", "a:b"]
    for _ in range(300):
        hdrs = {rng.choice(names): rng.choice(values) for _ in range(rng.randrange(0, 5))}
        ours = await _sent(SizedClient(), hdrs)
        assert ours == await _sent(Client(), hdrs), hdrs
        if hdrs:
            # What the size check counts is what goes on the wire.
            assert message_size(b"body", hdrs) == len(header_block(hdrs)) + len(b"body")
    for reply in ("_INBOX.x.1", ""):  # and without headers: an ack, a held list
        assert await _sent(SizedClient(), None, reply) == await _sent(Client(), None, reply)
        assert await _sent(SizedClient(), {"A": "b"}, reply) == await _sent(
            Client(), {"A": "b"}, reply
        )
    for bad in ("Bad Name", "tab\tname", "ünï"):
        with pytest.raises(BadHeaderError):
            await _sent(SizedClient(), {bad: "v"})
        with pytest.raises(BadHeaderError):
            await _sent(Client(), {bad: "v"})
    for subject in ("", "a b", "a\r\nb"):
        with pytest.raises(BadSubjectError):
            await SizedClient().publish(subject, b"", headers={"A": "b"})
