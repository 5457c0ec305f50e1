"""The write pattern of a step whose commit is its successor's work item (issue 53, lever 1),
on raw JetStream: what a turn would cost if the engine stored that and nothing else.

Today a step stores its commit (a KV CAS), then its records (events, history entries) and its
successor (a step message), each a write the server syncs before it acknowledges, most of them
one after another (``jetloop.tooling.bench.floor`` makes that pattern). Here the commit is the
only write on a step's path:

- the state bucket's stream has a durable consumer on ``turn.>``: every revision of a turn's
  record is delivered as the work of the step it says is due, its ack-wait the lease, and a
  commit is a CAS on the revision that was delivered (two workers on one revision: one CAS
  loses, which is the takeover rule of today's claim);
- a step's records are folded into the value it commits (the record sized so), and the log
  readers follow is a stream that *sources* the state stream: the server copies each write
  into it, off every step's path (its syncs still count: they share the disk);
- a model step's usage is published beside its commit (in flight together; the commit holds
  it too, so a reader counts a key once), not before it;
- a model step's calls run in the delivery of the record that lists them, side by side, their
  outcomes committed as they finish, those that finish during a commit sharing the next one
  (:class:`Outcomes`); the commit that holds the last outcome moves the turn (the join).

Per 7-step turn (the peer's: one model step asking for five calls, the five calls, a model
step that answers): 7 CAS writes (the request: the turn's record and the session's; model
step 0: 1; the calls: 2, as the five no-op calls finish, the first alone and the other four
during its commit; model step 1: its commit and the session's), 2 usage publishes, the request
publish and 5 acks (the completed record's delivery is acked with nothing to do); serially on
the path about 6 synced writes. Today's pattern stores 13 state writes, 10 log messages and 3
step messages for the same turn. Left out, as the floor leaves them out: reads, encoding, sealing,
heartbeats; and the per-step claim, which this pattern replaces by the CAS on the delivered
revision (a step that makes a single-attempt write still stores its in-doubt mark first, as
today: the bench's calls are reads).

The client hears a turn's end as it would watch the turn's key: a core message after the
commit that completes it.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from jetloop.tooling.bench.floor import serve, worker_args

TURNS = "FLOOR1_TURNS"
BUCKET = "floor1_state"
STATE_STREAM = f"KV_{BUCKET}"
LOG = "FLOOR1_LOG"
TURNS_CONSUMER = "floor1_turns"
WORK_CONSUMER = "floor1_work"
COMPLETED = "floor1.event.*.turn.completed"
CONNECTION_NAME = "jetloop-floor1-worker"

# What a turn record says is due (the value's first byte).
MODEL0, CALLS, MODEL1, DONE = b"0", b"c", b"1", b"d"


def turn_subject(session_id: str, turn_id: str, fan: int) -> str:
    return f"floor1.turn.{session_id}.{turn_id}.{fan}"


async def apply_topology(js: JetStreamContext) -> None:
    """The request stream, the state bucket with a work consumer on its turn records, and the
    log stream sourced from the state stream."""
    await js.add_stream(
        api.StreamConfig(
            name=TURNS,
            subjects=["floor1.turn.>"],
            retention=api.RetentionPolicy.WORK_QUEUE,
            storage=api.StorageType.FILE,
            duplicate_window=3600.0,
        )
    )
    await js.create_key_value(
        api.KeyValueConfig(bucket=BUCKET, history=8, storage=api.StorageType.FILE)
    )
    await js.add_stream(
        api.StreamConfig(
            name=LOG,
            subjects=["floor1.usage.>"],  # and, sourced, every write of the state
            storage=api.StorageType.FILE,
            duplicate_window=3600.0,
            sources=[api.StreamSource(name=STATE_STREAM)],
        )
    )
    for stream, name, subject in (
        (TURNS, TURNS_CONSUMER, "floor1.turn.>"),
        (STATE_STREAM, WORK_CONSUMER, f"$KV.{BUCKET}.turn.>"),
    ):
        await js.add_consumer(
            stream,
            api.ConsumerConfig(
                durable_name=name,
                name=name,
                filter_subject=subject,
                ack_policy=api.AckPolicy.EXPLICIT,
                ack_wait=30.0,
                max_ack_pending=10_000,
            ),
        )


class Lever1Worker:
    """Handles requests and turn-record revisions with only the writes lever 1 makes."""

    def __init__(self, nc: Client, kv: KeyValue, kv_bytes: int, msg_bytes: int) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.kv = kv
        # A record carries what the step's records would have said: sized for one more message.
        self.value = b"v" * (kv_bytes + msg_bytes)
        self.body = b"m" * msg_bytes
        self.sessions: dict[str, int] = {}

    async def handle(self, msg: Msg) -> None:
        if msg.subject.startswith("floor1.turn."):
            _, _, sid, tid, fan = msg.subject.split(".")
            await self.request(sid, tid, int(fan))
        else:
            await self.step(msg)
        await msg.ack_sync(timeout=5.0)

    async def session(self, sid: str) -> None:
        last = self.sessions.get(sid)
        if last is None:
            self.sessions[sid] = await self.kv.create(f"session.{sid}", self.value)
        else:
            self.sessions[sid] = await self.kv.update(f"session.{sid}", self.value, last=last)

    async def request(self, sid: str, tid: str, fan: int) -> None:
        # The turn's record, model step 0 due: the step's work item.
        await self.kv.create(f"turn.{sid}.{tid}", MODEL0 + str(fan).encode() + b"|" + self.value)
        await self.session(sid)

    async def step(self, msg: Msg) -> None:
        key = msg.subject.split(".", 2)[2]  # $KV.<bucket>.<key>
        _, sid, tid = key.split(".")
        due, rest = msg.data[:1], msg.data[1:]
        fan = int(rest.split(b"|", 1)[0])
        revision = msg.metadata.sequence.stream
        if due == DONE:
            return  # the completed record: nothing is due
        if due == CALLS:
            await Outcomes(self.kv, sid, tid, self.value).run(fan, key, MODEL1 + rest, revision)
            return
        # A model step: its usage beside its commit, in flight together.
        usage = await self.js.publish_async(
            f"floor1.usage.{sid}", self.body, headers={"Nats-Msg-Id": f"{key}.{due.decode()}.usage"}
        )
        following = CALLS if due == MODEL0 and fan > 0 else DONE
        await asyncio.gather(usage, self.kv.update(key, following + rest, last=revision))
        if following == DONE:
            await self.session(sid)
            await self.nc.publish(
                f"floor1.event.{sid}.turn.completed", b"", headers={"Jl-Turn": tid}
            )


class Outcomes:
    """The calls of one model step, side by side, their outcomes committed as they finish:
    outcomes that finish while a commit is in flight share the next one. A commit that holds
    every outcome is the join, a CAS on the turn's record (the next step's work item); one that
    does not goes to the calls' own record, outside the work consumer's filter, so no partial
    set of outcomes is ever delivered as work."""

    def __init__(self, kv: KeyValue, sid: str, tid: str, value: bytes) -> None:
        self.kv, self.value = kv, value
        self.key = f"calls.{sid}.{tid}.0"
        self.revision: int | None = None  # of the calls' record, once written
        self.pending: list[int] = []
        self.done = 0
        self.lock = asyncio.Lock()

    async def run(self, fan: int, turn_key: str, joined: bytes, turn_revision: int) -> None:
        async def call(i: int) -> None:
            await asyncio.sleep(0)  # the tool (the bench's are no-ops), run as a task
            self.pending.append(i)
            async with self.lock:  # one commit at a time; the next takes all that waited
                if not self.pending:
                    return  # committed by the one before
                self.done += len(self.pending)
                self.pending.clear()
                if self.done == fan:
                    await self.kv.update(turn_key, joined, last=turn_revision)
                elif self.revision is None:
                    self.revision = await self.kv.create(self.key, self.value)
                else:
                    self.revision = await self.kv.update(self.key, self.value, last=self.revision)

        await asyncio.gather(*(call(i) for i in range(fan)))


def worker_main() -> None:
    """Entry of the worker process (``jetloop.tooling.bench.floor.worker_args``)."""
    url, kv_bytes, msg_bytes, concurrency = worker_args()
    asyncio.run(
        serve(
            url,
            CONNECTION_NAME,
            BUCKET,
            ((TURNS, TURNS_CONSUMER), (STATE_STREAM, WORK_CONSUMER)),
            lambda nc, kv: Lever1Worker(nc, kv, kv_bytes, msg_bytes).handle,
            concurrency,
        )
    )
