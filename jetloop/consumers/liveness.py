"""Is the attempt that claimed this step still alive? A new delivery asks before it takes over.

A delivery that finds another attempt's unfinished claim (a call in doubt or running, a
model step's or a summary's attempt) must not settle it while its holder lives: the delivery
count says nothing about that (a nats-server restarted on its store may deliver a message a
live worker still holds as delivery 1). The holder's own writes do: its claim, then a
heartbeat every third of the lease, each rewrites the claimed record, so the time the server
stored the record is the holder's last sign of life.

Silence is counted only while the holder could have broken it. A server restart or a
failover cuts every process off at once; a live one connects again when it can — later on a
busy machine — and until it has, it neither beats nor answers. So the holder's silence runs
from its last write or from the moment this process's own link to the servers last opened,
whichever is later, and "no responders" from a process is no evidence of anything until this
process has been linked for ``RECONNECT_GRACE``. The claim is lost when:

- the holder has been silent for longer than the lease (it died, stalled or was cut off for
  longer than the lease: the rule of the lease) — unless the holder, asked on
  ``jl.alive.<incarnation>`` with the key, answers that it still works on it: its heartbeat
  writes are then waiting out an election or a restart, and it is given up to ``BEAT_GRACE``
  more for one of them to land (a stalled holder does not answer in time); or
- the message was handed on by ``jetloop.services.rescue`` (header ``Jl-Holder-Lost`` naming the
  holder's incarnation), this process has been linked for ``RECONNECT_GRACE``, and the holder
  does not answer on ``jl.alive.<incarnation>`` — asked again here, so a forged or stale
  header cannot take a live worker's step; or
- the holder is this very process, which no longer works on the step (its delivery ended).

Otherwise the delivery waits: ``RetryLater`` until the lease would lapse, then it looks again.

A lost claim is not always a lost worker. A holder that answers that it no longer works on
the key, and this very process, are alive: their delivery ended without finishing the step
(a write that failed past its retries in an outage, a fence it took for lost). The step is
resumed all the same — a call it had begun may have run — but that is not a loss of the turn
(``Takeover.ABANDONED``, ``jetloop.consumers.losses``): no worker died or stalled.
"""

from __future__ import annotations

import asyncio
import time
from enum import Enum

import structlog
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from jetloop.consumers.errors import RetryLater
from jetloop.consumers.runtime import Delivery
from jetloop.schemas import Attempt
from jetloop.streams.bus import H_HOLDER_LOST
from jetloop.streams.connection import link_of, linked_for
from jetloop.streams.topology import alive_subject

log = structlog.get_logger("jetloop.liveness")

ASK_TIMEOUT = 0.5
# A request naming a key is answered HOLDING while this process works on that key.
HOLDING = b"holding"
# How long a holder's state writes are tried again through an outage (StateStore.retry_for).
BEAT_GRACE = 15.0
# How long a live process is given to connect again after an outage that cut this one off
# too, counted from this process's own new link: until then its silence and its "no
# responders" say nothing. nats-py tries again every 0.5 s; a worker on a machine with
# other work on it was seen back 1.2 s after a server restart (and taken for dead then).
RECONNECT_GRACE = 3.0


async def settled_link(nc: Client) -> None:
    """Return once this process's link has been up for ``RECONNECT_GRACE``: from then on, a
    process that does not answer is not merely still connecting again."""
    while True:
        linked = linked_for(nc)
        if linked >= RECONNECT_GRACE:
            return
        # Not an event: the link may drop and open again meanwhile, so it is measured again.
        await asyncio.sleep(RECONNECT_GRACE - linked + 0.01)


# How long a process whose connection the server reported closed is asked, again and again,
# before it counts as gone, by the reason the server gave (``patience_after``). A live process
# that lost its connection connects again and answers within it. On a cluster a request can
# also go unanswered for a moment after a death (the dead subscription is still known on
# other nodes): silence is asked again, not taken as an answer either way.
CLIENT_CLOSED = "Client Closed"  # the process closed its socket: its kernel did, if killed
READ_ERROR = "Read Error"  # also what a process killed with unread data in its socket gives
# The server's write to the socket failed (not a timeout: the peer reset it), what a killed
# process's socket gives when the server was writing to it (deliveries, heartbeats, pings).
WRITE_ERROR = "Write Error"
GONE_PATIENCE = 0.75
ASK_AGAIN_TIMEOUT = 0.2


def patience_after(reason: str) -> float:
    """How long a process whose connection closed for ``reason`` is given to answer.

    Its own close: none ("no responders" is final at once). A read or a write error (the
    socket was reset): ``GONE_PATIENCE``, short, since that is also how the server sees most
    killed workers (which of the two depends on whether it was reading from the socket or
    writing to it), and a live process whose socket was reset reconnects at once. Any other
    (a slow consumer, a stale connection: the server gave up on a live process that was
    slow): ``RECONNECT_GRACE``."""
    if reason == CLIENT_CLOSED:
        return 0.0
    if reason in (READ_ERROR, WRITE_ERROR):
        return GONE_PATIENCE
    return RECONNECT_GRACE


async def gone(nc: Client, incarnation: str, patience: float = 0.0) -> bool:
    """Whether the process ``incarnation``, whose connection the server reported closed, is
    gone: it does not answer on ``jl.alive`` within ``patience`` seconds. With none, "no
    responders" is final at once; with some, the process may be connecting again, and
    silence is asked again until the patience runs out."""
    deadline = time.monotonic() + patience
    while True:
        try:
            await nc.request(alive_subject(incarnation), b"", timeout=ASK_AGAIN_TIMEOUT)
            return False
        except NoRespondersError:
            if patience <= 0:
                return True
        except (NatsTimeoutError, TimeoutError):
            pass
        if time.monotonic() >= deadline:
            return True
        await asyncio.sleep(0.1)


# How long a process whose subscription the server it was linked to no longer knows is asked
# again before it counts as gone (``silent``): a live one whose connection that server closed
# (a slow consumer) connects again at once and subscribes before anything else.
SILENT_PATIENCE = 0.5
SILENT_ASK_EVERY = 0.1


async def silent(nc: Client, incarnation: str, patience: float = SILENT_PATIENCE) -> bool:
    """Whether every ask of ``incarnation`` on ``jl.alive`` for ``patience`` seconds was
    answered "no responders" by the server instance this process stayed linked to
    throughout. An answer, a timeout (a slow or stalled process, or a server that cannot
    tell yet) or a link that dropped or moved meanwhile: False, "not known to be gone"."""
    link = link_of(nc)
    if link is None:
        return False
    deadline = time.monotonic() + patience
    while True:
        try:
            await nc.request(alive_subject(incarnation), b"", timeout=ASK_AGAIN_TIMEOUT)
            return False
        except NoRespondersError:
            pass
        except Exception:  # a timeout, a link lost meanwhile: nothing is known
            return False
        if link_of(nc) != link:
            return False
        if time.monotonic() >= deadline:
            return True
        await asyncio.sleep(SILENT_ASK_EVERY)


async def still_holds(nc: Client, incarnation: str, key: str) -> bool | None:
    """Whether the process ``incarnation`` says it still works on ``key``: True or False as it
    answers, None when it does not answer in time (gone, or stalled: SIGSTOP)."""
    try:
        reply = await nc.request(alive_subject(incarnation), key.encode(), timeout=ASK_TIMEOUT)
    except (NoRespondersError, NatsTimeoutError, TimeoutError):
        return None
    return reply.data == HOLDING


class Takeover(Enum):
    """Why a claim may be taken over."""

    LOST = "lost"  # its holder is gone, stalled or silent past the lease: a loss of the turn
    ABANDONED = "abandoned"  # its holder lives and no longer works on it: not a loss


async def holder_lost(d: Delivery, key: str, held: Attempt, stored_at: float) -> Takeover:
    """Return when the attempt ``held`` (read from ``key``, stored at ``stored_at``) may be
    taken over, and why; raise ``RetryLater`` while its holder still works on it."""
    rt = d.rt
    if held.incarnation == rt.incarnation:
        if key in rt.holding:
            raise RetryLater(rt.lease_seconds / 2, f"this worker still runs attempt {held.no}")
        log.info("step.holder_abandoned", holder=held.worker, key=key, own=True)
        return Takeover.ABANDONED  # our own earlier delivery ended without finishing it
    linked = linked_for(rt.nc)
    # Silent since its last write, or since this process's link opened, if later: an outage
    # that cut this process off cut the holder off too.
    silence = min(time.time() - stored_at, linked)
    if silence > rt.lease_seconds:
        # No sign of life within the lease. A holder that still works on the step and says so
        # is waiting out an election or a restart (its writes are tried again for up to
        # BEAT_GRACE): give its next beat a chance. One that is gone, stalled (no answer in
        # time) or done with the step is lost, as the lease says.
        said = None
        if silence < rt.lease_seconds + BEAT_GRACE:
            said = await still_holds(rt.nc, held.incarnation, key)
            if said:
                why = f"attempt {held.no} of worker {held.worker} still runs (its beats are late)"
                raise RetryLater(rt.lease_seconds / 3, why)
        log.info(
            "step.holder_stale",
            holder=held.worker,
            incarnation=held.incarnation,
            key=key,
            silence=round(silence, 2),
            said=said,
        )
        # It answered: alive, and done with the key (its delivery ended unfinished).
        return Takeover.ABANDONED if said is False else Takeover.LOST
    if (d.msg.headers or {}).get(H_HOLDER_LOST) == held.incarnation:
        if linked < RECONNECT_GRACE:
            # This process is just back from an outage (or just started): the holder may be
            # too, still connecting. Asked once it has had the time.
            why = f"worker {held.worker} may still be connecting again ({linked:.1f}s linked)"
            raise RetryLater(RECONNECT_GRACE - linked + 0.05, why)
        # Asked again here, so a stale or forged header cannot take a live worker's step.
        if await gone(rt.nc, held.incarnation):
            log.info("step.holder_gone", holder=held.worker, incarnation=held.incarnation)
            return Takeover.LOST
    wait = max(0.05, rt.lease_seconds - silence + 0.05)
    why = f"attempt {held.no} of worker {held.worker} is alive (silent {silence:.1f}s)"
    raise RetryLater(wait, why)


async def own_unstarted(d: Delivery, key: str, held: Attempt) -> bool:
    """Whether ``held`` is an attempt of this process that no delivery here works on and
    whose paid work never began (``jetloop.consumers.runtime.Unstarted``): the caller
    continues it under its own number — no takeover, no loss, nothing in doubt. Raises
    ``RetryLater`` while a delivery here still runs it."""
    if not d.rt.took_unstarted(key, held):
        return False
    try:
        await holder_lost(d, key, held, 0.0)
    except BaseException:
        d.rt.unstarted.claiming(key, held.no)
        raise
    return True
