"""Reading a NATS header block (``Name: Value`` per line) the way nats-py does, for less.

Every message a worker receives carries one: a step's identity, a direct get's stream,
subject and sequence, a pull request's status. nats-py 2.16 parses each name with a
generator over its characters (``any(c.isspace() for c in key)``); in a worker's profile
that parse was a tenth of its busy time (docs/performance.md). Header names repeat (a few
dozen in all), so here each distinct name is checked once, by nats-py's own rule, and its
verdict remembered; values are decoded as nats-py decodes them. The result is the same
dict for every input (``tests/test_headers.py`` compares the two).
"""

from __future__ import annotations

_CRLF = b"\r\n"
# Raw name → the key it is read as, or None for a name nats-py skips. Bounded: a peer that
# sends endless distinct names only makes the parse as slow as nats-py's.
_NAMES: dict[bytes, str | None] = {}
_MOST_NAMES = 1024


def _key_of(name: bytes) -> str | None:
    """nats-py's rule: the stripped name, ASCII, with no whitespace inside."""
    try:
        key = name.strip().decode("ascii")
    except UnicodeDecodeError:
        return None
    if any(c.isspace() for c in key):
        return None
    return key


def parse_header_lines(raw: bytes) -> dict[str, str]:
    """The headers of one block (the lines after ``NATS/1.0``), as nats-py reads them."""
    out: dict[str, str] = {}
    names = _NAMES
    for line in raw.split(_CRLF):
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = names[name]
        except KeyError:
            key = _key_of(name)
            if len(names) < _MOST_NAMES:
                names[name] = key
        if key is not None:
            out[key] = value.strip().decode("utf-8", "replace")
    return out


_STATUS = "Status"
_DESCRIPTION = "Description"


def read_header_block(block: bytes) -> dict[str, str] | None:
    """The headers of a whole block (``NATS/1.0`` line included) as nats-py's
    ``Client._process_headers`` reads them, status line and all, without a coroutine.

    A status line (``NATS/1.0 404 No Messages``) gives ``Status`` and ``Description``; the
    steps below are nats-py's, in its order, so that every block reads the same
    (``tests/test_protocol.py`` compares the two over random blocks).
    """
    hdr: dict[str, str] | None = None
    rest = block[8:]  # after "NATS/1.0"
    if rest[:1] == b" ":
        line = block[9:]
        status = line[:3].strip().decode()
        desc = line[4 : len(line) - 4]
        hdr = {}
        if status.isdigit():
            hdr[_STATUS] = status
        rest = rest[rest.find(_CRLF) + 2 :]
        if desc:
            i = desc.find(_CRLF)
            if i > 0:
                hdr[_DESCRIPTION] = desc[:i].decode()
                hdr.update(parse_header_lines(desc[i + 2 :]))
            else:
                hdr[_DESCRIPTION] = desc.decode()
    if len(rest) <= 2:
        return hdr
    parsed = parse_header_lines(block[10:])
    if hdr:
        hdr.update(parsed)
    else:
        hdr = parsed
    return hdr or None
