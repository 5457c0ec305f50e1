"""Prometheus metrics of the engine (prometheus-client's default registry).

Steps by kind and outcome, step latency, redeliveries, takeovers, ``outcome_unknown`` calls,
approvals asked and decided (pending = asked - decided), consumer lag, the process's clock
offset from the NATS server's and whether it is refusing to serve for it. The gateway serves
them on ``/metrics``; a worker alone serves them on ``JETLOOP_METRICS_PORT`` when set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog
from nats.js import JetStreamContext
from prometheus_client import Counter, Gauge, Histogram

log = structlog.get_logger("jetloop.metrics")

STEPS = Counter("jetloop_steps_total", "Step messages handled", ["kind", "outcome"])
STEP_SECONDS = Histogram(
    "jetloop_step_seconds",
    "Time to handle one step message",
    ["kind"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
REDELIVERIES = Counter("jetloop_redeliveries_total", "Step messages delivered again", ["kind"])
TAKEOVERS = Counter("jetloop_takeovers_total", "Attempts found lost and taken over")
OUTCOME_UNKNOWN = Counter("jetloop_outcome_unknown_total", "Calls settled outcome_unknown")
APPROVALS_ASKED = Counter("jetloop_approvals_requested_total", "Calls held for approval")
APPROVALS_DECIDED = Counter("jetloop_approvals_decided_total", "Approval decisions recorded")
CONSUMER_PENDING = Gauge(
    "jetloop_consumer_pending", "Messages not yet delivered, per consumer", ["consumer"]
)
CONSUMER_ACK_PENDING = Gauge(
    "jetloop_consumer_ack_pending", "Messages delivered and not acked, per consumer", ["consumer"]
)
CONSUMER_REDELIVERED = Gauge(
    "jetloop_consumer_redelivered", "Messages being redelivered, per consumer", ["consumer"]
)
CLOCK_OFFSET = Gauge(
    "jetloop_clock_offset_seconds",
    "This process's clock minus the NATS server's, as last measured (positive: ahead)",
)
CLOCK_OFF = Gauge(
    "jetloop_clock_off",
    "1 while this process's clock is too far off to seal: it serves no steps or control requests",
)


def step_done(kind: str, outcome: str, seconds: float) -> None:
    """Count one handled step and its time (the labelled children looked up once each:
    ``labels`` costs a lock and a tuple per call, on every step)."""
    pair = _STEP_CHILDREN.get((kind, outcome))
    if pair is None:
        pair = (STEPS.labels(kind, outcome), STEP_SECONDS.labels(kind))
        if len(_STEP_CHILDREN) < 256:  # kinds come from message headers: bounded
            _STEP_CHILDREN[(kind, outcome)] = pair
    pair[0].inc()
    pair[1].observe(seconds)


_STEP_CHILDREN: dict[tuple[str, str], tuple[Counter, Histogram]] = {}


async def watch_lag(
    js: JetStreamContext,
    stop: asyncio.Event,
    consumers: Sequence[tuple[str, str]],
    every: float = 10.0,
) -> None:
    """Read the lag of ``consumers`` (stream, durable) now and then (one request each)."""
    while not stop.is_set():
        for stream, name in consumers:
            try:
                info = await js.consumer_info(stream, name)
            except Exception as exc:  # an outage: the next round reads again
                log.debug("metrics.lag_unavailable", consumer=name, error=str(exc))
                continue
            CONSUMER_PENDING.labels(name).set(info.num_pending or 0)
            CONSUMER_ACK_PENDING.labels(name).set(info.num_ack_pending or 0)
            CONSUMER_REDELIVERED.labels(name).set(info.num_redelivered or 0)
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass
