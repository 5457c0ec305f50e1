"""The usage ledger's totals: tokens and dollars per turn, session, agent, model and day.

The ledger is the ``model.usage`` events (``jetloop.consumers.usage`` writes one per model
call that got an answer, every attempt included). Whoever reads them — ``jetloop usage`` from
the stream, the gateway's ``/v1/usage`` and the console from the read model — sums them here,
each key once, so the three always agree.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from jetloop.schemas import Event
from jetloop.schemas.events import ModelUsageData

GROUPS = ("all", "turn", "session", "agent", "model", "day")


@dataclass(frozen=True)
class UsageLine:
    """One model call's record in the ledger."""

    key: str
    session_id: str
    turn_id: str
    at: float
    agent: str
    model: str | None
    purpose: str
    model_step: int
    attempt: int
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int
    cost_usd: float | None

    @classmethod
    def of(cls, event: Event) -> UsageLine:
        data = event.payload()
        if not isinstance(data, ModelUsageData):
            raise ValueError(f"event {event.key} is a {event.type}, not model.usage")
        return cls.recorded(event.key, event.session_id, event.turn_id or "", event.at, data)

    @classmethod
    def recorded(
        cls, key: str, session_id: str, turn_id: str, at: float, data: ModelUsageData
    ) -> UsageLine:
        """The line of a ``model.usage`` event, from its key, ids, time and data."""
        return cls(
            key=key,
            session_id=session_id,
            turn_id=turn_id,
            at=at,
            agent=data.agent,
            model=data.model,
            purpose=data.purpose,
            model_step=data.model_step,
            attempt=data.attempt,
            input_tokens=data.input_tokens,
            output_tokens=data.output_tokens,
            cached_input_tokens=data.cached_input_tokens,
            cost_usd=data.cost_usd,
        )

    @property
    def day(self) -> str:
        """The UTC day of the call, ``YYYY-MM-DD``."""
        return time.strftime("%Y-%m-%d", time.gmtime(self.at))

    def group(self, by: str) -> str:
        match by:
            case "all":
                return "all"
            case "turn":
                return f"{self.session_id}/{self.turn_id}"
            case "session":
                return self.session_id
            case "agent":
                return self.agent
            case "model":
                return self.model or "unknown"
            case "day":
                return self.day
        raise ValueError(f"cannot group usage by {by!r}: one of {', '.join(GROUPS)}")


@dataclass
class Totals:
    """What a group of model calls used. ``priced_cost_usd`` sums the priced calls;
    ``unpriced_calls`` says how many had no price (their tokens are in the sums);
    ``cost_usd`` is the cost of them all, so ``None`` when one is unpriced: never a guess,
    and never a sum that reads as the whole (a dashboard adding it up would say $0)."""

    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    priced_cost_usd: float = 0.0
    unpriced_calls: int = 0
    models: list[str] = field(default_factory=list)

    @property
    def cost_usd(self) -> float | None:
        return None if self.unpriced_calls else self.priced_cost_usd

    def add(self, line: UsageLine) -> None:
        self.calls += 1
        self.input_tokens += line.input_tokens
        self.output_tokens += line.output_tokens
        self.cached_input_tokens += line.cached_input_tokens
        if line.cost_usd is None:
            self.unpriced_calls += 1
        else:
            self.priced_cost_usd = round(self.priced_cost_usd + line.cost_usd, 9)
        model = line.model or "unknown"
        if model not in self.models:
            self.models.append(model)

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "cost_usd": self.cost_usd, "tokens": self.tokens}


def distinct(lines: Iterable[UsageLine]) -> list[UsageLine]:
    """Each key once (a record read twice, from a redelivery or two sources, counts once)."""
    seen: dict[str, UsageLine] = {}
    for line in lines:
        seen.setdefault(line.key, line)
    return list(seen.values())


def totals(lines: Iterable[UsageLine], by: str = "all") -> dict[str, Totals]:
    """The totals of ``lines`` per group (``GROUPS``), groups in the order first seen."""
    if by not in GROUPS:
        raise ValueError(f"cannot group usage by {by!r}: one of {', '.join(GROUPS)}")
    out: dict[str, Totals] = {}
    for line in distinct(lines):
        out.setdefault(line.group(by), Totals()).add(line)
    return out


def totals_json(lines: Iterable[UsageLine], by: str = "all") -> dict[str, Any]:
    """``totals`` as the CLI's ``--json`` and the gateway's ``/v1/usage`` answer it."""
    lines = distinct(lines)
    return {
        "by": by,
        "total": totals(lines)["all"].as_json() if lines else Totals().as_json(),
        "groups": [{"group": k, **v.as_json()} for k, v in totals(lines, by).items()],
    }
