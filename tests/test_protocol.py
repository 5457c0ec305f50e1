"""The worker connection's protocol reader delivers what nats-py's parser delivers.

Both parsers are fed the same random streams of server operations (messages with and
without headers, reply subjects and status lines, PING, PONG, +OK, INFO), cut into chunks
at random places, and what each hands on is compared: the messages in order, with their
headers read, and the other operations. The real-server tests (test_replies, test_intake,
and every engine test) run the reader on the wire.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from nats.aio.client import Client
from nats.errors import ProtocolError
from nats.protocol.parser import Parser

from jetloop.streams.connection import SizedClient
from jetloop.streams.headers import read_header_block
from jetloop.streams.protocol import FastParser

INLINE_SID = 1
QUEUED_SID = 2

BLOCKS = [
    b"NATS/1.0\r\nNats-Msg-Id: s1.t1.m0.c3\r\nJl-Kind: call_tool\r\n\r\n",
    b"NATS/1.0\r\nNats-Stream: KV_jl_state\r\nNats-Subject: $KV.jl_state.turn.s.t\r\n"
    b"Nats-Sequence: 42\r\nNats-Time-Stamp: 2026-11-30T12:00:00.1Z\r\n\r\n",
    b"NATS/1.0 404 No Messages\r\n\r\n",
    b"NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 1\r\nNats-Pending-Bytes: 0\r\n\r\n",
    b"NATS/1.0 503\r\n\r\n",
    b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 1016\r\nNats-Last-Stream: 1024\r\n\r\n",
    b"NATS/1.0 409 Message Size Exceeds MaxBytes\r\n\r\n",
    b"NATS/1.0\r\nBad Name: skipped\r\nno colon\r\nOk: v\xc3\xa4lue \r\n\r\n",
]


def _message(rng: random.Random, sid: int) -> bytes:
    subject = rng.choice([b"_INBOX.abc.7", b"$JS.ACK.s.c.1.2.3.4.5", b"a"])
    reply = rng.choice([b"", b"", b"$JS.ACK.JL_STEPS.bench.1.9.9.1764000000.0"])
    body = bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 5, 60, 900])))
    spaces = rng.choice([b" ", b" ", b"\t", b"  "])
    if rng.random() < 0.6:
        block = rng.choice(BLOCKS)
        args = [b"HMSG", subject, str(sid).encode()]
        if reply:
            args.append(reply)
        args += [str(len(block)).encode(), str(len(block) + len(body)).encode()]
        return spaces.join(args) + b"\r\n" + block + body + b"\r\n"
    args = [b"MSG", subject, str(sid).encode()]
    if reply:
        args.append(reply)
    args.append(str(len(body)).encode())
    return spaces.join(args) + b"\r\n" + body + b"\r\n"


def _stream(rng: random.Random) -> bytes:
    others = [b"PING\r\n", b"PONG\r\n", b"+OK\r\n", b'INFO {"max_payload":1048576}\r\n']
    ops = []
    for _ in range(rng.randrange(1, 30)):
        r = rng.random()
        if r < 0.8:
            ops.append(_message(rng, rng.choice([INLINE_SID, QUEUED_SID])))
        else:
            ops.append(rng.choice(others))
    return b"".join(ops)


def _chunks(rng: random.Random, data: bytes) -> list[bytes]:
    cuts = sorted(rng.randrange(len(data) + 1) for _ in range(rng.randrange(0, 8)))
    out, at = [], 0
    for cut in [*cuts, len(data)]:
        out.append(data[at:cut])
        at = cut
    return out


class _Heard:
    """What a parser handed on, in order."""

    def __init__(self, nc: Client) -> None:
        self.items: list[tuple[Any, ...]] = []
        self.nc = nc

        async def msg(sid: int, subject: bytes, reply: bytes, data: bytes, hdr: Any) -> None:
            headers = await Client._process_headers(nc, hdr) if hdr else None
            self.items.append(("msg", sid, bytes(subject), bytes(reply), data, headers))

        async def ping() -> None:
            self.items.append(("ping",))

        async def pong() -> None:
            self.items.append(("pong",))

        async def info(i: dict[str, Any]) -> None:
            self.items.append(("info", i))

        nc._process_msg = msg  # type: ignore[method-assign]
        nc._process_ping = ping  # type: ignore[method-assign]
        nc._process_pong = pong  # type: ignore[method-assign]
        nc._process_info = info  # type: ignore[method-assign]


async def _through_nats_py(chunks: list[bytes]) -> list[tuple[Any, ...]]:
    heard = _Heard(Client())
    parser = Parser(heard.nc)
    for chunk in chunks:
        await parser.parse(chunk)
    return heard.items


async def _through_fast(chunks: list[bytes]) -> tuple[list[tuple[Any, ...]], FastParser]:
    nc = SizedClient()
    heard = _Heard(nc)

    def inline(subject: bytes, reply: bytes, data: bytes, headers: dict[str, str] | None) -> None:
        heard.items.append(("msg", INLINE_SID, subject, reply, data, headers))

    nc._inline[INLINE_SID] = inline
    parser = nc._ps
    assert isinstance(parser, FastParser)
    for chunk in chunks:
        await parser.parse(chunk)
    return heard.items, parser


async def test_random_streams_cut_anywhere_read_as_nats_py_reads_them() -> None:
    rng = random.Random(15)
    for _ in range(400):
        data = _stream(rng)
        chunks = _chunks(rng, data)
        expected = await _through_nats_py([data])
        assert await _through_nats_py(chunks) == expected  # the reference, cut or not
        got, parser = await _through_fast(chunks)
        assert got == expected, chunks
        assert not parser.buf  # everything read


async def test_a_stream_one_byte_at_a_time() -> None:
    rng = random.Random(16)
    data = b"".join(_message(rng, INLINE_SID) for _ in range(5)) + b"PING\r\n"
    got, _ = await _through_fast([data[i : i + 1] for i in range(len(data))])
    assert got == await _through_nats_py([data])


async def test_an_unfinished_message_waits_for_its_body() -> None:
    rng = random.Random(17)
    data = _message(rng, INLINE_SID)
    got, parser = await _through_fast([data[:-3]])
    assert got == [] and bytes(parser.buf) == data[:-3]
    await parser.parse(data[-3:])
    assert len(got) == 1 and not parser.buf


@pytest.mark.parametrize(
    "line", [b"MSG a\r\n", b"HMSG a 1 x y\r\n", b"MSG a 1 2 3 4 5\r\n", b"NOPE\r\n"]
)
async def test_a_malformed_operation_is_a_protocol_error(line: bytes) -> None:
    with pytest.raises(ProtocolError):
        await _through_fast([line])


def test_header_blocks_read_as_nats_py_reads_them() -> None:
    rng = random.Random(18)
    nc = Client()
    alphabet = b"ab-: \t\r\n\xc3\xa9\xff0123456789"
    blocks = list(BLOCKS)
    for _ in range(2000):
        status = rng.choice([b"", b" 404", b" 503 ", b" 100 Idle", b" 4x4 Odd", b" "])
        tail = bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        blocks.append(b"NATS/1.0" + status + b"\r\n" + tail + b"\r\n\r\n")
    for block in blocks:
        try:
            expected = _run(Client._process_headers(nc, block))
        except UnicodeDecodeError:
            with pytest.raises(UnicodeDecodeError):
                read_header_block(block)
            continue
        assert read_header_block(block) == expected, block


def _run(coro: Any) -> Any:
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("nats-py's header read awaited something")
