"""Reading the NATS protocol off the socket, for less than nats-py's parser costs.

nats-py's ``Parser`` tries each operation against regular expressions in turn, copies
every body out of a ``bytearray`` twice, deletes what it read from the front of that
buffer (moving the rest of it), and awaits a coroutine per message. A worker reads some
eighty messages per 7-step turn, almost all of them ``MSG``/``HMSG``; in its profile that
parsing was a sixth of its busy time (docs/performance.md).

``FastParser`` reads a chunk where it lies: each message's control line is split on
whitespace, its header block and body are sliced once, and a message for an inline
subscription (``SizedClient.subscribe_inline``) goes to its handler at once, without a
coroutine. Every other operation (``PING``, ``PONG``, ``+OK``, ``-ERR``, ``INFO``, and
anything unknown, which nats-py refuses as a protocol error) is handed with the rest of the
chunk to nats-py's own parser, so how those are handled does not change; once nats-py's
parser has read what it was given, this one takes over again. Messages arrive in the order
they were read either way (``tests/test_protocol.py`` feeds both parsers the same random
streams, cut at random places, and compares what each delivered).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nats.errors import ProtocolError
from nats.protocol.parser import AWAITING_CONTROL_LINE, Parser

if TYPE_CHECKING:
    from jetloop.streams.connection import SizedClient

_CRLF = b"\r\n"
_H = ord("H")
_M = ord("M")


class FastParser(Parser):
    """nats-py's parser with its message path replaced; state it keeps between chunks:
    ``buf`` (the unread tail, from the start of an operation) and how long that tail must
    grow before the message it starts is whole."""

    nc: SizedClient

    def reset(self) -> None:
        super().reset()
        self._whole_at = 0
        # Told apart from the reset of a reconnect that happens while a message is handed
        # over (nats-py's ``_process_msg`` awaits): the old chunk is then not read further.
        self._generation = getattr(self, "_generation", 0) + 1

    async def parse(self, data: bytes = b"") -> None:
        if self.state != AWAITING_CONTROL_LINE:
            # nats-py's parser stopped inside a message's body: it reads on until it is whole.
            await super().parse(data)
            return
        buf = self.buf
        if buf:
            buf.extend(data)
            if len(buf) < self._whole_at:
                return
            data = bytes(buf)
            buf.clear()
        self._whole_at = 0
        nc = self.nc
        inline = nc._inline
        generation = self._generation
        end = len(data)
        pos = 0
        while pos < end:
            eol = data.find(_CRLF, pos)
            if eol < 0:
                break  # the control line is not whole yet
            first = data[pos]
            if first == _H and data.startswith(b"HMSG ", pos):
                args = data[pos + 5 : eol].split()
                if len(args) == 5:
                    subject, sid, reply, header_size, total_size = args
                elif len(args) == 4:
                    subject, sid, header_size, total_size = args
                    reply = b""
                else:
                    raise ProtocolError("nats: malformed HMSG")
            elif first == _M and data.startswith(b"MSG ", pos):
                args = data[pos + 4 : eol].split()
                if len(args) == 4:
                    subject, sid, reply, total_size = args
                elif len(args) == 3:
                    subject, sid, total_size = args
                    reply = b""
                else:
                    raise ProtocolError("nats: malformed MSG")
                header_size = b"0"
            else:
                # Not a message: nats-py's parser reads it, and whatever follows in this chunk.
                buf.extend(data[pos:])
                await super().parse()
                return
            try:
                sub_id = int(sid)
                headers_end = eol + 2 + int(header_size)
                body_end = eol + 2 + int(total_size)
            except ValueError:
                raise ProtocolError("nats: malformed MSG") from None
            if body_end + 2 > end:
                # The body is not all here: keep the message from its control line.
                buf.extend(data[pos:])
                self._whole_at = body_end + 2 - pos
                return
            pos = body_end + 2
            if headers_end > eol + 2:
                block: bytes | None = data[eol + 2 : headers_end]
            else:
                block = None
            handler = inline.get(sub_id)
            if handler is not None:
                nc.hand_inline(handler, subject, reply, data[headers_end:body_end], block)
                continue
            # None without headers, as nats-py's parser passes it (its signature says bytes).
            body = data[headers_end:body_end]
            await nc._process_msg(sub_id, subject, reply, body, block)  # type: ignore[arg-type]
            if self._generation != generation:
                return  # reset meanwhile (a reconnect): the rest belonged to the old link
        if pos < end:
            buf.extend(data[pos:])
