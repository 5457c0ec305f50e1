"""The usage ledger's writer: each model call's tokens and cost, recorded as its answer lands.

A model step (and a compaction's summary call) records what its call used right after the
answer arrived (a model step beside its commit of the answer, both in flight at once; a
compaction before its commit): an attempt that a crash then makes repeat was paid for, and
is counted, once — its record's key names the attempt
(``<session>.<turn>.m<step>.a<attempt>.usage``), so the same attempt published again (a
retried publish, a redelivery that finds it recorded) is the same message id, and the
readers (``jetloop.sessions.usage``) count a key once. Records are ``model.usage`` events
in the session's log (``JL_EVENTS``, kept as long as the log); Prometheus counts the same
tokens and dollars per agent and model in the process that paid them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from prometheus_client import Counter

from jetloop.agents import ModelRequest, ModelResponse
from jetloop.agents.prices import Prices
from jetloop.schemas import Event, EventType, TurnRecord, decode
from jetloop.schemas.events import ModelUsageData
from jetloop.streams.bus import Bus, Outgoing, event_out
from jetloop.streams.topology import EVENTS_STREAM, event_subject

if TYPE_CHECKING:
    from jetloop.consumers.runtime import Runtime

TOKENS = Counter(
    "jetloop_model_tokens_total",
    "Tokens of model calls answered (every attempt), by agent, model and kind",
    ["agent", "model", "kind"],
)
COST = Counter(
    "jetloop_model_cost_usd_total",
    "US dollars of model calls answered (every attempt), by agent and model (priced models)",
    ["agent", "model"],
)


def usage_key(session_id: str, turn_id: str, model_step: int, attempt: int, purpose: str) -> str:
    step = f"m{model_step}" if purpose == "answer" else f"m{model_step}.{purpose}"
    return f"{session_id}.{turn_id}.{step}.a{attempt}.usage"


def model_of(adapter: Any, response: ModelResponse | None = None) -> str | None:
    """The answering model's name: the response's, else the adapter's ``model``."""
    if response is not None and response.model:
        return response.model
    name = getattr(adapter, "model", None)
    return name if isinstance(name, str) and name else None


def usage_event(
    prices: Prices, adapter: Any, request: ModelRequest, response: ModelResponse
) -> Event:
    """The ledger's record of the call ``request`` that ``adapter`` answered with
    ``response`` (the request says whose: agent, session, turn, step, attempt, purpose)."""
    return _ledger_record(
        prices,
        request.agent,
        request.session_id,
        request.turn_id,
        request.model_step,
        request.attempt,
        request.purpose,
        model_of(adapter, response),
        response.usage,
    )


def usage_again(rt: Runtime, turn: TurnRecord) -> list[Outgoing]:
    """The ledger's record of the call that answered ``turn``'s current model step, again,
    from the committed record: a step found answered when delivered again tells it once more,
    for the commit and the usage were in flight together and a server that stopped between
    them may have kept only the commit. The same key: the stream drops it as a duplicate when
    the first landed, and readers count a key once. Nothing for a step that no model call
    answered (a turn failed or cancelled before), or whose agent this worker does not serve."""
    agent = rt.app.agent(turn.agent)
    if agent is None or not turn.usage or turn.attempts < 1:
        return []
    record = _ledger_record(
        rt.prices,
        turn.agent,
        turn.session_id,
        turn.turn_id,
        turn.model_step,
        turn.attempts,
        "answer",
        model_of(agent.model),
        turn.usage,
    )
    return [event_out(record)]


def _ledger_record(
    prices: Prices,
    agent: str,
    session_id: str,
    turn_id: str,
    model_step: int,
    attempt: int,
    purpose: str,
    model: str | None,
    u: dict[str, int],
) -> Event:
    return Event.of(
        ModelUsageData(
            agent=agent,
            model_step=model_step,
            attempt=attempt,
            purpose=purpose,
            model=model,
            input_tokens=int(u.get("input_tokens", 0)),
            output_tokens=int(u.get("output_tokens", 0)),
            cached_input_tokens=int(u.get("cached_input_tokens", 0)),
            cost_usd=prices.cost(model, u),
        ),
        key=usage_key(session_id, turn_id, model_step, attempt, purpose),
        session_id=session_id,
        turn_id=turn_id,
    )


async def record_usage(bus: Bus, event: Event) -> ModelUsageData:
    """Publish one call's usage (confirmed) and count it in this process's metrics."""
    await bus.publish([event_out(event)])
    data = event.payload()
    assert isinstance(data, ModelUsageData)
    model = data.model or "unknown"
    for kind in ("input", "output", "cached_input"):
        n = getattr(data, f"{kind}_tokens")
        if n:
            TOKENS.labels(data.agent, model, kind).inc(n)
    if data.cost_usd:
        COST.labels(data.agent, model).inc(data.cost_usd)
    return data


async def lost_call(
    js: JetStreamContext, session_id: str, turn_id: str, model_step: int, attempt: int
) -> ModelUsageData | None:
    """What a lost attempt of a model step paid for, if its call got an answer: the
    session's last ``model.usage`` record, when it is that attempt's (nothing in the session
    calls a model after a model step's attempt until the step is resumed). Read from the
    stream's leader; only a resumed step asks."""
    subject = event_subject(session_id, EventType.MODEL_USAGE.value)
    try:
        msg = await js.get_last_msg(EVENTS_STREAM, subject)
    except NotFoundError:
        return None
    event = decode(Event, msg.data or b"")
    if event.key != usage_key(session_id, turn_id, model_step, attempt, "answer"):
        return None
    data = event.payload()
    return data if isinstance(data, ModelUsageData) else None
