"""What flow control toward a provider costs a model step, and tracing when it is off
(``jetloop bench limits``).

Three paths, measured in the same run on the rig's server:

- an endpoint **without limits**: the step looks its endpoint up in the pauses this worker
  heard (a dict) and finds no limits (``Runtime.limits_of``): in-process, no round trip;
- an endpoint **with limits** (``JETLOOP_PROVIDER_LIMITS``): the call is admitted into the
  window before it is made and settled after (``jetloop.streams.windows``: each a
  compare-and-set of one ``jl_limits`` key, a read and a write);
- the **baseline**: one KV get of a ``jl_limits`` key, the smallest round trip there is;
- **tracing off** (no OTLP endpoint, or no ``otel`` extra): what a model step pays for the
  span it would have made — a null context and a no-op.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from jetloop.agents import ModelRequest, ModelResponse
from jetloop.consumers.runtime import Runtime
from jetloop.consumers.tracing import answered, model_span
from jetloop.schemas import TurnRecord
from jetloop.streams.pauses import Pauses
from jetloop.streams.topology import LIMITS_BUCKET
from jetloop.streams.windows import Admitted, EndpointLimits, Windows
from jetloop.tooling.bench.rig import Rig


@dataclass
class LimitsResult:
    calls: int
    unlimited_us: float  # per model step: the pause lookup and the limits lookup
    tracing_off_us: float  # per model step without an OTLP endpoint: the span placeholder
    limited_p50_ms: float  # admit + settle
    limited_mean_ms: float
    slot_p50_ms: float  # concurrent: take a slot and free it
    baseline_p50_ms: float  # one KV get
    ratio_p50: float  # limited / baseline


class _Adapter:
    provider = "openai"
    base_url = "https://api.example.invalid/v1"
    model = "bench-model"


async def limit_cost(r: Rig, calls: int) -> LimitsResult:
    kv = await r.js.key_value(LIMITS_BUCKET)
    await kv.put("bench.baseline", b"{}")
    windows = Windows(kv)
    limits = EndpointLimits.model_validate(
        {"requests_per_minute": 10**9, "tokens_per_minute": 10**12}
    )
    adapter = _Adapter()
    endpoint = "pause.openai.bench"
    # Without limits: what every model step pays (no Runtime needed beyond its lookups).
    rt = Runtime.__new__(Runtime)
    rt.provider_limits = {}
    pauses = Pauses()
    began = time.perf_counter()
    for _ in range(calls * 10):
        pauses.remaining(endpoint)
        rt.limits_of(adapter)
    unlimited_us = (time.perf_counter() - began) / (calls * 10) * 1e6
    # Tracing off: the model span is a null context, the answer's attributes a no-op.
    turn = TurnRecord(session_id="s", turn_id="t", agent="a", request_id="r", text="")
    request = ModelRequest(agent="a", instructions="", messages=[], tools=[], attempt=1)
    response = ModelResponse(text="ok")
    began = time.perf_counter()
    for _ in range(calls * 10):
        with model_span(None, turn, request, adapter) as span:
            answered(span, response)
    tracing_off_us = (time.perf_counter() - began) / (calls * 10) * 1e6
    limited: list[float] = []
    baseline: list[float] = []
    slots: list[float] = []
    capped = EndpointLimits.model_validate({"concurrent": 64})

    async def never_stale(holder: dict[str, object]) -> bool:
        return True

    for _ in range(calls):
        t = time.perf_counter()
        await kv.get("bench.baseline")
        baseline.append(time.perf_counter() - t)
        t = time.perf_counter()
        got = await windows.admit(endpoint, limits)
        assert isinstance(got, Admitted)
        await windows.settle(got, 1000)
        limited.append(time.perf_counter() - t)
        t = time.perf_counter()
        slot = await windows.take_slot(endpoint, capped, {"no": 1}, never_stale)
        assert slot is not None and slot.key
        await windows.free_slot(slot)
        slots.append(time.perf_counter() - t)
    p50 = statistics.median(limited) * 1000
    base = statistics.median(baseline) * 1000
    return LimitsResult(
        calls=calls,
        unlimited_us=round(unlimited_us, 3),
        tracing_off_us=round(tracing_off_us, 3),
        limited_p50_ms=round(p50, 3),
        limited_mean_ms=round(statistics.mean(limited) * 1000, 3),
        slot_p50_ms=round(statistics.median(slots) * 1000, 3),
        baseline_p50_ms=round(base, 3),
        ratio_p50=round(p50 / base, 2) if base else 0.0,
    )


def format_limits(res: LimitsResult) -> str:
    return "\n".join(
        [
            "### Flow control toward a provider, and tracing off, per model call",
            "",
            "| path | p50 | ratio to one KV get |",
            "|---|---:|---:|",
            f"| endpoint without limits (in-process lookups) | {res.unlimited_us:.2f} µs | – |",
            f"| tracing off (no OTLP endpoint): the span placeholder | {res.tracing_off_us:.2f} µs "
            "| – |",
            f"| endpoint with limits (admit + settle) | {res.limited_p50_ms:.3f} ms "
            f"| {res.ratio_p50:.2f}× |",
            f"| endpoint with a concurrency cap (take + free a slot) | {res.slot_p50_ms:.3f} ms "
            f"| {res.slot_p50_ms / res.baseline_p50_ms if res.baseline_p50_ms else 0:.2f}× |",
            f"| baseline: one KV get | {res.baseline_p50_ms:.3f} ms | 1.00× |",
            "",
            f"{res.calls} calls; mean with limits {res.limited_mean_ms:.3f} ms.",
        ]
    )
