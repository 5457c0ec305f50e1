"""The JetStream topology, declared once and applied idempotently at start-up.

Every stream, consumer and bucket jetloop uses is named here; nothing else in the code spells a
subject by hand. ``apply`` creates what is missing and updates what exists with a whole config
(docs/design.md, JetStream facts: a read-modify-write update can drop fields nats-py does not know).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.errors import Error as NatsError
from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError, NotFoundError

from jetloop.schemas.kinds import Pool
from jetloop.schemas.log import LogLayout

TURNS_STREAM = "JL_TURNS"
STEPS_STREAM = "JL_STEPS"
EVENTS_STREAM = "JL_EVENTS"
# The key of JL_EVENTS's metadata that names the session log's layout (jetloop.schemas.log).
LOG_LAYOUT_KEY = "jetloop_log"
DEAD_STREAM = "JL_DEAD"
STATE_BUCKET = "jl_state"
BLOB_BUCKET = "jl_blobs"
# Which agents workers serve: ``agent.<name>`` is written once by the first worker that
# serves an agent and kept (a client can tell "no such agent" from "no worker right now");
# ``worker.<id>`` is each live worker's presence, refreshed well inside the bucket's TTL.
AGENTS_BUCKET = "jl_agents"
WORKERS_BUCKET = "jl_workers"
PRESENCE_TTL = 15.0
# What the workers of a deployment share about model providers: ``pause.<provider>.<endpoint>``,
# until when a provider asked (429 Retry-After) to be left alone (jetloop.streams.pauses).
LIMITS_BUCKET = "jl_limits"
LIMITS_TTL = 3600.0

# Named once, with the step kinds each pool serves (``jetloop.schemas.kinds``).
SESSION_POOL = Pool.SESSION.value
MODEL_POOL = Pool.MODEL.value
TOOL_POOL = Pool.TOOL.value
POOLS = (SESSION_POOL, MODEL_POOL, TOOL_POOL)

# Before turns and steps were routed by agent, one consumer per pool served every agent;
# ``apply`` removes them (on a work-queue stream they would overlap the per-agent ones).
LEGACY_CONSUMERS = ((TURNS_STREAM, "jl_turns"), *((STEPS_STREAM, f"jl_{p}") for p in POOLS))


def turn_subject(agent: str, session_id: str) -> str:
    return f"jl.turn.{agent}.{session_id}"


def trigger_subject(agent: str, name: str) -> str:
    return f"jl.cron.{agent}.{name}"


def session_turns_filter(session_id: str) -> str:
    return f"jl.turn.*.{session_id}"


def step_subject(pool: str, agent: str, kind: str, session_id: str) -> str:
    return f"jl.step.{pool}.{agent}.{kind}.{session_id}"


def timer_subject(session_id: str, call_key: str) -> str:
    """One subject per timer: a subject holds one schedule (docs/design.md, JetStream facts)."""
    return f"jl.sched.{session_id}.{call_key.replace('.', '_')}"


def is_step_subject(subject: str) -> bool:
    """Whether ``subject`` is a step's (only workers publish there)."""
    return subject.startswith("jl.step.")


def step_subject_parts(subject: str) -> list[str]:
    """``[agent, kind, session]`` of a step subject (fewer or more when it is malformed)."""
    return subject.split(".")[3:]


def turn_consumer(agent: str) -> str:
    """The durable that hands one agent's turn requests to the workers serving it."""
    return f"jl_turns_{agent}"


def step_consumer(pool: str, agent: str) -> str:
    """The durable of one pool of one agent: only workers that serve the agent pull it."""
    return f"jl_{pool}_{agent}"


def agent_consumers(agent: str, pools: tuple[str, ...] = POOLS) -> list[tuple[str, str]]:
    """(stream, consumer) of every durable a worker serving ``agent`` in ``pools`` pulls."""
    out = [(TURNS_STREAM, turn_consumer(agent))] if SESSION_POOL in pools else []
    return out + [(STEPS_STREAM, step_consumer(p, agent)) for p in pools]


def event_subject(session_id: str, event_type: str) -> str:
    return f"jl.event.{session_id}.{event_type}"


def history_subject(session_id: str, role: str) -> str:
    return f"jl.event.{session_id}.history.{role}"


def history_filter(session_id: str) -> str:
    return f"jl.event.{session_id}.history.>"


def live_subject(session_id: str, turn_id: str) -> str:
    """Core NATS (no stream): streamed model text as it arrives, header Jl-Attempt."""
    return f"jl.live.{session_id}.{turn_id}"


def session_events_filter(session_id: str) -> str:
    return f"jl.event.{session_id}.>"


def alive_subject(incarnation: str) -> str:
    """Core NATS request subject a worker process answers while it lives (no stream)."""
    return f"jl.alive.{incarnation}"


def held_key(incarnation: str) -> str:
    """The ``jl_workers`` key listing the messages one worker process holds."""
    return f"held.{incarnation}"


def dead_subject(original_subject: str) -> str:
    return f"jl.dead.{original_subject}"


@dataclass(frozen=True)
class TopologyConfig:
    """What an operator may tune; the rest of the topology is fixed by the design."""

    replicas: int = 1
    lease_seconds: float = 5.0
    step_dedupe_seconds: float = 3600.0
    event_dedupe_seconds: float = 3600.0
    turn_dedupe_seconds: float = 3600.0
    state_history: int = 8
    max_ack_pending: int = 1000
    # The session log's layout (jetloop.schemas.log), kept in JL_EVENTS's metadata for every
    # worker and reader; None: as the stream has it (folded for a new one; separate for one
    # made before layouts, which says none).
    event_log: LogLayout | None = None


def stream_configs(cfg: TopologyConfig) -> list[api.StreamConfig]:
    r = cfg.replicas
    # Direct gets are answered by any replica, so on R3 they can read a follower that has
    # not caught up (nats-server#6970): a call step could read a turn record from before its
    # answer and stop. With one replica there is nothing to lag, so keep the fast path.
    direct = r == 1
    return [
        api.StreamConfig(
            name=TURNS_STREAM,
            description="jetloop turn requests and user messages",
            # jl.cron.> holds the schedules of triggers (one subject per trigger); each fire
            # is published to its jl.turn.<agent>.<session> target.
            subjects=["jl.turn.>", "jl.cron.>"],
            allow_msg_schedules=True,
            # A work queue: an accepted request is deleted, so the first stored message of a
            # session is the next to accept (FIFO); state dedupes what the window forgets.
            retention=api.RetentionPolicy.WORK_QUEUE,
            storage=api.StorageType.FILE,
            num_replicas=r,
            duplicate_window=cfg.turn_dedupe_seconds,
        ),
        api.StreamConfig(
            name=STEPS_STREAM,
            description="jetloop step work items, and the schedules of durable timers",
            subjects=["jl.step.>", "jl.sched.>"],
            allow_msg_schedules=True,
            # Limits retention keeps acked steps (and so their dedupe ids) across restarts.
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            num_replicas=r,
            duplicate_window=cfg.step_dedupe_seconds,
            max_age=7 * 24 * 3600.0,
        ),
        api.StreamConfig(
            name=EVENTS_STREAM,
            description="jetloop session logs: history, outcomes, audit",
            subjects=["jl.event.>"],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            num_replicas=r,
            duplicate_window=cfg.event_dedupe_seconds,
            allow_direct=direct,
            # A new deployment's log is folded; an existing one keeps its layout (``apply``).
            metadata={LOG_LAYOUT_KEY: cfg.event_log or LogLayout.FOLDED},
        ),
        api.StreamConfig(
            name=DEAD_STREAM,
            description="jetloop dead letters: messages that could not be handled, with reason",
            subjects=["jl.dead.>"],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            num_replicas=r,
            duplicate_window=cfg.step_dedupe_seconds,
        ),
        api.StreamConfig(
            name=f"KV_{STATE_BUCKET}",
            description="jetloop state: sessions, turns, calls",
            subjects=[f"$KV.{STATE_BUCKET}.>"],
            storage=api.StorageType.FILE,
            num_replicas=r,
            allow_direct=direct,
            allow_rollup_hdrs=True,
            allow_msg_ttl=True,
            allow_atomic=True,
            deny_delete=True,
            discard=api.DiscardPolicy.NEW,
            max_msgs_per_subject=cfg.state_history,
            duplicate_window=120.0,
        ),
    ]


def consumer_configs(
    cfg: TopologyConfig, agent: str, pools: tuple[str, ...] = POOLS
) -> list[tuple[str, api.ConsumerConfig]]:
    """The durables of one agent: its turn requests, and one per pool for its steps."""
    common = {
        "ack_policy": api.AckPolicy.EXPLICIT,
        "ack_wait": cfg.lease_seconds,
        # Attempts are counted in state (claims), not deliveries: never give up here.
        "max_deliver": -1,
        "max_ack_pending": cfg.max_ack_pending,
        "deliver_policy": api.DeliverPolicy.ALL,
    }
    out: list[tuple[str, api.ConsumerConfig]] = []
    if SESSION_POOL in pools:
        out.append(
            (
                TURNS_STREAM,
                api.ConsumerConfig(
                    durable_name=turn_consumer(agent),
                    name=turn_consumer(agent),
                    description=f"jetloop turn requests of agent {agent}",
                    filter_subject=f"jl.turn.{agent}.>",
                    **common,  # type: ignore[arg-type]
                ),
            )
        )
    for pool in pools:
        out.append(
            (
                STEPS_STREAM,
                api.ConsumerConfig(
                    durable_name=step_consumer(pool, agent),
                    name=step_consumer(pool, agent),
                    description=f"jetloop {pool} steps of agent {agent}",
                    filter_subject=f"jl.step.{pool}.{agent}.>",
                    **common,  # type: ignore[arg-type]
                ),
            )
        )
    return out


async def apply_agent(
    js: JetStreamContext, cfg: TopologyConfig, agent: str, pools: tuple[str, ...] = POOLS
) -> None:
    """Create (or update) the durables of one agent; every worker that serves it does this.

    A turn request or step published while no worker serves the agent waits in its stream
    and is delivered (``DeliverPolicy.ALL``) once the first one does.
    """
    for stream, cc in consumer_configs(cfg, agent, pools):
        await js.add_consumer(stream, cc)


async def log_layout(js: JetStreamContext) -> LogLayout:
    """The session log's layout, as ``JL_EVENTS``'s metadata says (``separate`` when it says
    nothing, or nothing this version knows: a stream made before layouts)."""
    info = await js.stream_info(EVENTS_STREAM)
    said = (info.config.metadata or {}).get(LOG_LAYOUT_KEY)
    return LogLayout.FOLDED if said == LogLayout.FOLDED else LogLayout.SEPARATE


async def apply(js: JetStreamContext, cfg: TopologyConfig, set_replicas: bool = False) -> None:
    """Create or update every stream, consumer and bucket; safe to run any number of times.

    An existing stream keeps its replica count unless ``set_replicas``: a worker started
    with a different JETLOOP_REPLICAS must not quietly move a cluster's streams.
    """
    for sc in stream_configs(cfg):
        assert sc.name is not None
        try:
            info = await js.stream_info(sc.name)
        except NotFoundError:
            await placed(js.add_stream, sc)
            continue
        if not set_replicas and info.config.num_replicas:
            sc.num_replicas = info.config.num_replicas
        if sc.name == EVENTS_STREAM:
            # The layout stays as it is unless this apply sets it; the server's own keys stay.
            kept = dict(info.config.metadata or {})
            if cfg.event_log is None:
                kept.setdefault(LOG_LAYOUT_KEY, LogLayout.SEPARATE)
            else:
                kept[LOG_LAYOUT_KEY] = cfg.event_log
            sc.metadata = kept
        await placed(js.update_stream, sc)
    for stream, name in LEGACY_CONSUMERS:
        try:
            await js.delete_consumer(stream, name)
        except NotFoundError:
            pass
    await _registry(js, cfg)
    try:
        await js.object_store(BLOB_BUCKET)
    except NotFoundError:
        await js.create_object_store(
            BLOB_BUCKET,
            config=api.ObjectStoreConfig(
                bucket=BLOB_BUCKET,
                description="jetloop large payloads",
                storage=api.StorageType.FILE,
                replicas=cfg.replicas,
            ),
        )


async def _registry(js: JetStreamContext, cfg: TopologyConfig) -> None:
    """The small JSON buckets: which agents are served (see AGENTS_BUCKET), and what the
    workers share about providers (LIMITS_BUCKET)."""
    for bucket, ttl, what in (
        (AGENTS_BUCKET, None, "jetloop agents any worker has served"),
        (WORKERS_BUCKET, PRESENCE_TTL, "jetloop live workers and the agents they serve"),
        (LIMITS_BUCKET, LIMITS_TTL, "jetloop model provider pauses shared by the workers"),
    ):
        try:
            await js.key_value(bucket)
        except NotFoundError:
            await js.create_key_value(
                api.KeyValueConfig(
                    bucket=bucket,
                    description=what,
                    history=1,
                    ttl=ttl,
                    storage=api.StorageType.FILE,
                    replicas=cfg.replicas,
                )
            )


async def placed(
    op: Callable[[api.StreamConfig], Awaitable[object]],
    sc: api.StreamConfig,
    seconds: float = 30.0,
) -> None:
    """A cluster that just formed may not know all its peers yet: "no suitable peers for
    placement" (10005) then passes within seconds."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            await op(sc)
            return
        except BadRequestError as exc:
            if exc.err_code != 10005 or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def present(js: JetStreamContext) -> list[str]:
    """Names of the parts of the topology that are missing (empty when all is there)."""
    missing: list[str] = []
    for sc in stream_configs(TopologyConfig()):
        assert sc.name is not None
        try:
            await js.stream_info(sc.name)
        except NotFoundError:
            missing.append(sc.name)
    return missing


def stream_names(cfg: TopologyConfig | None = None) -> list[str]:
    """Every stream of the topology, the buckets' and the object store's included."""
    names = [sc.name for sc in stream_configs(cfg or TopologyConfig()) if sc.name is not None]
    buckets = (STATE_BUCKET, AGENTS_BUCKET, WORKERS_BUCKET, LIMITS_BUCKET)
    return names + [f"KV_{b}" for b in buckets] + [f"OBJ_{BLOB_BUCKET}"]


async def leaderless(js: JetStreamContext, timeout: float = 2.0) -> list[str]:
    """The topology's streams that exist on a cluster but have no leader now (after some
    power cuts of every node nats-server leaves one so: docs/design.md, "What is not
    promised"). One that does not answer, or a single server, names nothing."""
    out: list[str] = []
    for name in stream_names():
        try:
            info = await asyncio.wait_for(js.stream_info(name), timeout)
        except (NatsError, TimeoutError):
            continue
        cluster = info.cluster
        if cluster is not None and cluster.name and not cluster.leader:
            out.append(name)
    return out
