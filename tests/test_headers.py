"""The header parser the worker's connection uses reads every block as nats-py does."""

from __future__ import annotations

import random

from nats.aio.client import Client

from jetloop.streams.connection import SizedClient
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
