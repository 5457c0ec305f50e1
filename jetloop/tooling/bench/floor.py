"""The raw JetStream floor of a turn: the engine's writes, publishes and acks, and nothing else.

A floor turn moves through the same streams, consumers and KV bucket shapes as an engine turn
and makes, per step, the same KV CAS writes, confirmed publishes (pipelined where the engine
pipelines them, each with a ``Nats-Msg-Id``) and confirmed acks (``ack_sync``), in the same
order: commit, publish records, publish the next steps, ack (records and steps together where
the engine sends them together, its next step checking that its inputs are in). What it leaves
out is what the engine adds: the reads (records, history), decoding and encoding with
pydantic, sealing, the scripted model and the tools, logs, heartbeats. The per-step counts, in
the folded log (the separate log's extra records in brackets):

    step          CAS writes                 publishes                                        ack
    turn request  turn, session              the user's entry [accepted, started], together   1
                                             with run_model 0
    run_model 0   claim; commit beside the   the assistant's entry [answered]; then one       1
                  usage publish              call_tools step
    call_tools    the step's reads, kept     one entry of every read's result [an entry       1
                  together; the turn (join)  and a call.outcome each], with run_model 1
    run_model 1   claim; commit beside the   the assistant's entry carrying turn.completed    1
                  usage publish; session     [turn.completed]

(a one-model-step turn is the turn request and run_model 0 answering at once, as run_model 1
does: 6 publishes of records [19], 9 CAS writes, 3 step publishes and 4 acks per 7-step turn
whose calls are reads). ``jetloop.tooling.bench.run`` prints these counts beside the engine's,
measured from stream sequences.

The floor worker runs in its own process (``python -c`` on ``floor_worker_main``), like an
engine worker, so both pay the same hops. It keeps the revisions it wrote in memory: it reads
nothing back, which is what makes it a floor.

With ``shards`` above 1 (``JETLOOP_FLOOR_SHARDS``, ``jetloop bench peer --floor-shards``) the
same writes go to that many state buckets and event streams, a session's to the one its id
hashes to: what spreading the engine's state and log over several streams would buy, measured
before it is built (docs/performance.md, "Lever 2 measured").
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import zlib
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from jetloop.streams.intake import Intake

TURNS = "FLOOR_TURNS"
STEPS = "FLOOR_STEPS"
EVENTS = "FLOOR_EVENTS"
BUCKET = "floor_state"
TURNS_CONSUMER = "floor_turns"
STEPS_CONSUMER = "floor_steps"
COMPLETED = "floor.*.*.turn.completed"
CONNECTION_NAME = "jetloop-floor-worker"
# The session log's layout the floor writes as (``folded`` or ``separate``), as the engine's.
LAYOUT_ENV = "JETLOOP_FLOOR_EVENT_LOG"
# How many state buckets and event streams the floor spreads its sessions over (1: one each).
SHARDS_ENV = "JETLOOP_FLOOR_SHARDS"


def shard_of(session_id: str, shards: int) -> int:
    """The shard a session's records and log entries go to."""
    return zlib.crc32(session_id.encode()) % shards if shards > 1 else 0


def state_bucket(shard: int) -> str:
    return BUCKET if shard == 0 else f"{BUCKET}_{shard}"


def events_stream(shard: int) -> str:
    return EVENTS if shard == 0 else f"{EVENTS}_{shard}"


def event_subject(session_id: str, shards: int, what: str) -> str:
    """A log entry's subject; shard 0's is the unsharded floor's (``floor.event.<sid>.…``),
    another's ``floor.ev<k>.<sid>.…``: the same tokens, so ``COMPLETED`` hears every end."""
    k = shard_of(session_id, shards)
    return f"floor.{'event' if k == 0 else f'ev{k}'}.{session_id}.{what}"


def turn_subject(session_id: str, turn_id: str, fan: int) -> str:
    """A floor turn request: ``fan`` calls in model step 0 (0: a one-model-step turn)."""
    return f"floor.turn.{session_id}.{turn_id}.{fan}"


async def apply_topology(js: JetStreamContext, shards: int = 1) -> None:
    """The floor's streams, consumers and bucket, shaped like the engine's (file storage,
    dedupe windows, a work-queue stream for requests, 8 revisions a key); ``shards`` state
    buckets and event streams."""
    for cfg in (
        api.StreamConfig(
            name=TURNS,
            subjects=["floor.turn.>"],
            retention=api.RetentionPolicy.WORK_QUEUE,
            storage=api.StorageType.FILE,
            duplicate_window=3600.0,
        ),
        api.StreamConfig(
            name=STEPS,
            subjects=["floor.step.>"],
            storage=api.StorageType.FILE,
            duplicate_window=3600.0,
        ),
        api.StreamConfig(
            name=EVENTS,
            subjects=["floor.event.>"],
            storage=api.StorageType.FILE,
            duplicate_window=3600.0,
        ),
        *(
            api.StreamConfig(
                name=events_stream(k),
                subjects=[f"floor.ev{k}.>"],
                storage=api.StorageType.FILE,
                duplicate_window=3600.0,
            )
            for k in range(1, shards)
        ),
    ):
        await js.add_stream(cfg)
    for k in range(shards):
        await js.create_key_value(
            api.KeyValueConfig(bucket=state_bucket(k), history=8, storage=api.StorageType.FILE)
        )
    for stream, name, subject in (
        (TURNS, TURNS_CONSUMER, "floor.turn.>"),
        (STEPS, STEPS_CONSUMER, "floor.step.>"),
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


def _headers(msg_id: str, tid: str) -> dict[str, str]:
    return {
        "Nats-Msg-Id": msg_id,
        "Jl-Kind": "floor",
        "Jl-Session": msg_id.split(".", 1)[0],
        "Jl-Turn": tid,
        "Jl-Step": msg_id,
        "Jl-Schema": "1",
    }


class FloorWorker:
    """Handles floor steps: only the writes, publishes and acks an engine step makes."""

    def __init__(
        self,
        nc: Client,
        kv: KeyValue,
        kv_bytes: int,
        msg_bytes: int,
        folded: bool = True,
        shards: int = 1,
    ) -> None:
        self.folded = folded  # the session log's layout the engine beside it writes
        self.nc = nc
        self.js = nc.jetstream()
        self.shards = shards
        self.kvs: list[KeyValue] = [kv]  # a bucket a shard, the others opened on first use
        self.value = b"v" * kv_bytes
        self.body = b"m" * msg_bytes
        self.revisions: dict[str, int] = {}

    async def cas(self, key: str) -> None:
        """A create (first write of a key) or an update from the revision written last, in
        the bucket of the key's session (its second token)."""
        if len(self.kvs) < self.shards:
            self.kvs = [await self.js.key_value(state_bucket(k)) for k in range(self.shards)]
        kv = self.kvs[shard_of(key.split(".")[1], self.shards)]
        last = self.revisions.get(key)
        if last is None:
            self.revisions[key] = await kv.create(key, self.value)
        else:
            self.revisions[key] = await kv.update(key, self.value, last=last)

    def event(self, sid: str, what: str) -> str:
        return event_subject(sid, self.shards, what)

    async def publish(self, subjects: Sequence[str], ids: Sequence[str], tid: str) -> None:
        """Confirmed publishes: one alone, several pipelined, as ``jetloop.streams.bus.Bus`` does,
        with the same headers as the engine's (``jetloop.streams.bus.headers``)."""
        if len(subjects) == 1:
            await self.js.publish(subjects[0], self.body, headers=_headers(ids[0], tid))
            return
        futures = [
            await self.js.publish_async(s, self.body, headers=_headers(i, tid))
            for s, i in zip(subjects, ids, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*futures), timeout=5.0)

    async def handle(self, msg: Msg) -> None:
        parts = msg.subject.split(".")
        if parts[1] == "turn":
            await self.turn_request(parts[2], parts[3], int(parts[4]))
        else:
            kind, sid, tid, fan, arg = parts[2], parts[3], parts[4], int(parts[5]), int(parts[6])
            await getattr(self, kind)(sid, tid, fan, arg)
        await msg.ack_sync(timeout=5.0)

    def _step(self, kind: str, sid: str, tid: str, fan: int, arg: int = 0) -> str:
        return f"floor.step.{kind}.{sid}.{tid}.{fan}.{arg}"

    async def turn_request(self, sid: str, tid: str, fan: int) -> None:
        await self.cas(f"turn.{sid}.{tid}")
        await self.cas(f"session.{sid}")
        base = f"{sid}.{tid}"
        records = [("history.user", f"{base}.user")]
        if not self.folded:
            records = [
                ("turn.accepted", f"{base}.accepted"),
                *records,
                ("turn.started", f"{base}.started"),
            ]
        await self.publish(
            [*(self.event(sid, s) for s, _ in records), self._step("model", sid, tid, fan)],
            [*(i for _, i in records), f"{base}.m0"],
            tid,
        )

    async def model(self, sid: str, tid: str, fan: int, n: int) -> None:
        key, base = f"turn.{sid}.{tid}", f"{sid}.{tid}"
        await self.cas(key)  # claim
        # The call's usage to the ledger, beside the commit (both in flight at once).
        usage = self.publish([self.event(sid, "model.usage")], [f"{base}.m{n}.a1.usage"], tid)
        await asyncio.gather(usage, self.cas(key))
        if n == 0 and fan > 0:
            answer = [("history.assistant", f"{base}.m0.assistant")]
            if not self.folded:
                answer.append(("model.answered", f"{base}.m0.answered"))
            await self.publish([self.event(sid, s) for s, _ in answer], [i for _, i in answer], tid)
            await self.publish([self._step("calls", sid, tid, fan, 0)], [f"{base}.m0.calls"], tid)
            return
        # (Folded, one message: the assistant's entry carrying turn.completed, on the subject
        # the bench hears a floor turn end on.)
        last = [("turn.completed", f"{base}.completed")]
        if not self.folded:
            last.insert(0, ("history.assistant", f"{base}.m{n}.assistant"))
        await self.publish([self.event(sid, s) for s, _ in last], [i for _, i in last], tid)
        await self.cas(f"session.{sid}")  # the session moves on, in the same step

    async def calls(self, sid: str, tid: str, fan: int, arg: int) -> None:
        """Every call of model step 0, a read each, side by side; their outcomes kept in one
        record, then the join moves the turn and the results go out with the next step."""
        base = f"{sid}.{tid}"
        await self.cas(f"call.{sid}.{tid}.0.reads")
        await self.cas(f"turn.{sid}.{tid}")
        # (Folded: one entry holding every result, carrying the outcomes, as the engine
        # tells a step's reads kept together.)
        results = [("history.tool", f"{base}.m0.results")]
        if not self.folded:
            results = [("history.tool", f"{base}.m0.c{j}.result") for j in range(fan)]
            results += [("call.outcome", f"call.{base}.0.{j}.outcome") for j in range(fan)]
        await self.publish(
            [
                *(self.event(sid, s) for s, _ in results),
                self._step("model", sid, tid, fan, 1),
            ],
            [*(i for _, i in results), f"{base}.m1"],
            tid,
        )


async def pull(
    js: JetStreamContext,
    stream: str,
    consumer: str,
    handle: Callable[[Msg], Coroutine[Any, Any, None]],  # a Handler
    concurrency: int,
    stop: asyncio.Event,
) -> None:
    """Take as many messages as there are free slots through the worker's own intake
    (``jetloop.streams.intake``: pull requests kept open, not nats-py's ``fetch(n)``, which
    sometimes holds a message that arrived on an idle consumer for its whole timeout), and
    ``handle`` each in a task of its own, as ``jetloop.services.worker`` does."""
    intake = Intake(js._nc, stream, consumer)  # the context's connection: no public name
    await intake.start()
    running: set[asyncio.Task[None]] = set()
    free = asyncio.Event()
    while not stop.is_set():
        room = concurrency - len(running)
        if room <= 0:
            free.clear()
            await free.wait()
            continue
        for m in await intake.take(room, timeout=1.0):
            task = asyncio.create_task(handle(m))
            running.add(task)

            def done(t: asyncio.Task[None]) -> None:
                running.discard(t)
                free.set()
                if not t.cancelled() and t.exception() is not None:
                    failed = f"{consumer}: a step failed: {t.exception()!r}"
                    print(failed, file=sys.stderr, flush=True)

            task.add_done_callback(done)
    if running:
        await asyncio.wait(running)
    for m in await intake.stop():
        await m.nak()


Handler = Callable[[Msg], Coroutine[Any, Any, None]]


async def serve(
    url: str,
    name: str,
    bucket: str,
    consumers: Sequence[tuple[str, str]],
    handler_of: Callable[[Client, KeyValue], Handler],
    concurrency: int,
) -> None:
    """Pull from each of ``consumers`` (stream, durable) into the handler ``handler_of``
    makes, until SIGTERM; print ``ready`` once pulling."""
    nc = await nats.connect(url, name=name)
    try:
        js = nc.jetstream()
        handle = handler_of(nc, await js.key_value(bucket))
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with asyncio.TaskGroup() as tg:
            for stream, consumer in consumers:
                tg.create_task(pull(js, stream, consumer, handle, concurrency, stop))
            print("ready", flush=True)
    finally:
        await nc.close()


def worker_args() -> tuple[str, int, int, int]:
    """A floor worker process's arguments: ``<url> <kv bytes> <msg bytes> <concurrency>``."""
    url, kv_bytes, msg_bytes, concurrency = sys.argv[1:5]
    return url, int(kv_bytes), int(msg_bytes), int(concurrency)


def floor_worker_main() -> None:
    """Entry of the floor worker process (``worker_args``)."""
    url, kv_bytes, msg_bytes, concurrency = worker_args()
    folded = os.environ.get(LAYOUT_ENV, "folded") == "folded"
    shards = int(os.environ.get(SHARDS_ENV, "1"))
    asyncio.run(
        serve(
            url,
            CONNECTION_NAME,
            BUCKET,
            ((TURNS, TURNS_CONSUMER), (STEPS, STEPS_CONSUMER)),
            lambda nc, kv: FloorWorker(nc, kv, kv_bytes, msg_bytes, folded, shards).handle,
            concurrency,
        )
    )
