"""How durable an acknowledgement is: when nats-server puts what it acknowledged on disk.

nats-server acknowledges a JetStream write (a PubAck, a KV update) once the write is in its
store's files, and by default syncs those files to disk only every two minutes
(``sync_interval``): a process crash loses nothing (the kernel still holds the pages), but
an OS crash, a kernel panic or a power cut takes back up to two minutes of acknowledged
writes. For jetloop that is an accepted turn, a decided approval, and the in-doubt mark a
single-attempt write stores before it runs: when the mark vanishes the step looks not
started after the reboot, and the write is made again.

So every server jetloop starts or configures (``jetloop up``, ``jetloop credentials`` for
compose and clusters, the trials and the benchmarks) syncs before it acknowledges
(``sync_interval: always``) unless the operator chooses otherwise with one setting,
``JETLOOP_NATS_SYNC`` (``up --nats-sync``): ``always``, or an interval in Go's duration syntax
(``2m`` is nats-server's own default) for a deployment that accepts the loss for speed.
docs/design.md, "What an acknowledgement survives", tells what each choice survives.
"""

from __future__ import annotations

import re

ALWAYS = "always"
# nats-server's own default: what a server that names no sync_interval does.
SERVER_DEFAULT = "2m"
# Go's time.ParseDuration, as nats-server reads sync_interval: one or more <number><unit>.
_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")


def check(value: str) -> str:
    """``value`` as a sync policy, or ``ValueError`` saying what is accepted."""
    v = value.strip().lower()
    if v == ALWAYS or (_DURATION.match(v) and any(c in "123456789" for c in v)):
        return v
    raise ValueError(
        f"{value!r} is not a sync policy: 'always' (sync before every acknowledgement, the"
        " default) or an interval such as '2m' (nats-server's own default) or '1s'"
    )


def server_block(sync: str) -> dict[str, object]:
    """The part of nats-server's config that sets ``sync``: a ``jetstream`` block (the
    command line's ``--jetstream --store_dir`` still name the store)."""
    return {"jetstream": {"sync_interval": check(sync)}}


def survives(sync: str) -> str:
    """What an acknowledged write survives under ``sync``, in words ``up`` prints."""
    if check(sync) == ALWAYS:
        return "a process crash, an OS crash or a power cut (synced before acknowledged)"
    return (
        f"a process crash only: an OS crash or a power cut loses what was acknowledged in the"
        f" last {sync} (set JETLOOP_NATS_SYNC=always to sync before acknowledging)"
    )
