"""This process's clock against the NATS server's: measured, watched, and a guard on sealing.

A seal binds the writer's clock time, and every reader compares it with the time the server
stored the record (``jetloop.streams.seal``). A writer whose clock is off by more than the
tolerance seals records every other process rejects, so a process measures how far its
clock is from the server's before it seals anything, and again now and then; past a safe
fraction of the tolerance (``ClockGuard``) its ``Sealer`` refuses to seal (``ClockOff``)
and a worker stops serving until the clock is back.

How it is measured: the server stamps every JetStream API answer it makes with its own
time; the stream info of the state bucket (``ts``, RFC 3339 with nanoseconds) is one small
request any role may make. The offset is that time minus the midpoint of when the request
was sent and when its answer came, and the true offset is within half the round trip of it
(the answer was made somewhere in between). The best of a few samples (the shortest round
trip) is kept, as NTP does.

Between two measurements the offset is carried forward on the monotonic clock, which no one
sets: a wall clock that jumps (set by hand, a VM resumed) is seen at the next seal, not at
the next measurement, so not one record is sealed with the jumped time.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from nats.aio.client import Client

from jetloop.schemas.errors import SealError
from jetloop.streams.topology import STATE_BUCKET

# Of the seal tolerance, how much the clock may use: the rest is for the write's own
# latency (a write tried again through an election is sealed anew each try).
SAFE_FRACTION = 0.5
# How often a process measures again.
CHECK_EVERY = 15.0
SAMPLES = 3


@dataclass(frozen=True)
class Reading:
    """One measurement: this process's clock minus the server's (positive: ahead), within
    ``error`` seconds either way, taken at ``wall`` (this clock) and ``mono`` (monotonic)."""

    offset: float
    error: float
    wall: float
    mono: float

    @property
    def server_time(self) -> float:
        """The server's time at the measurement (unix seconds)."""
        return self.wall - self.offset

    def now(self) -> float:
        """The offset now: the measured one, plus how far the wall clock has moved since
        other than the monotonic clock has (a jump, or a slew: NTP's are tiny)."""
        return self.offset + (time.time() - self.wall) - (time.monotonic() - self.mono)


class ClockOff(SealError):
    """This process's clock is too far from the NATS server's to seal state: a record it
    sealed would be rejected by every reader as sealed at another time than it was stored."""

    def __init__(self, offset: float, limit: float) -> None:
        super().__init__(
            f"this process's clock is {describe(offset)} the NATS server's (at most "
            f"{limit:g} s is safe): it seals no state until its clock is set right (NTP)"
        )
        self.offset = offset
        self.limit = limit


def describe(offset: float) -> str:
    """``90.2 s ahead of`` / ``3.0 s behind``: an offset in words, for logs and errors."""
    return f"{abs(offset):.1f} s {'ahead of' if offset >= 0 else 'behind'}"


def server_time(text: str) -> float:
    """An RFC 3339 time as the server writes it (``2026-12-02T08:08:06.013254797Z``, up to
    nanoseconds, which ``datetime`` does not read) as unix seconds."""
    head, _, frac = text.rstrip("Z").partition(".")
    base = datetime.fromisoformat(head).replace(tzinfo=UTC).timestamp()
    digits = "".join(c for c in frac if c.isdigit())
    return base + (int(digits) / 10 ** len(digits) if digits else 0.0)


async def measure(nc: Client, timeout: float = 2.0, samples: int = SAMPLES) -> Reading:
    """The offset of this process's clock from the server's, from ``samples`` stream info
    requests (the one with the shortest round trip). Raises what the request raises when
    the server does not answer."""
    subject = f"$JS.API.STREAM.INFO.KV_{STATE_BUCKET}"
    best: Reading | None = None
    for _ in range(samples):
        sent, sent_mono = time.time(), time.monotonic()
        reply = await nc.request(subject, b"", timeout=timeout)
        came, came_mono = time.time(), time.monotonic()
        stamp = json.loads(reply.data).get("ts")
        if not isinstance(stamp, str):
            raise ValueError(f"no server time in the answer to {subject}")
        at = server_time(stamp)
        wall = (sent + came) / 2
        reading = Reading(
            offset=wall - at,
            error=(came_mono - sent_mono) / 2,
            wall=wall,
            mono=(sent_mono + came_mono) / 2,
        )
        if best is None or reading.error < best.error:
            best = reading
    assert best is not None
    return best


class ClockGuard:
    """Whether this process may seal: off when its measured offset, with the measurement's
    error, is past ``limit`` (``SAFE_FRACTION`` of the seal tolerance). Not measured yet, or
    not measurable just now (no server), it keeps its last verdict."""

    def __init__(self, tolerance: float, fraction: float = SAFE_FRACTION) -> None:
        self.limit = tolerance * fraction
        self.reading: Reading | None = None
        self._measured = float("-inf")  # monotonic time of the last measurement tried

    def due(self, every: float) -> bool:
        """Whether the last measurement is older than ``every`` seconds (or there is none)."""
        return time.monotonic() - self._measured >= every

    def offset(self) -> float | None:
        """The offset now, as last measured and carried forward (None: never measured)."""
        return self.reading.now() if self.reading is not None else None

    @property
    def off(self) -> bool:
        r = self.reading
        return r is not None and abs(r.now()) + r.error > self.limit

    def check(self) -> None:
        """Raise ``ClockOff`` when this process must not seal."""
        r = self.reading
        if r is not None:
            offset = r.now()
            if abs(offset) + r.error > self.limit:
                raise ClockOff(offset, self.limit)

    async def update(self, nc: Client, timeout: float = 2.0) -> None:
        """Measure again. A measurement whose round trip is too long to tell (half of it past
        a quarter of the limit) changes nothing, and neither does one that fails (it
        raises): the last reading stands."""
        self._measured = time.monotonic()
        reading = await measure(nc, timeout)
        if reading.error <= self.limit / 4:
            self.reading = reading
