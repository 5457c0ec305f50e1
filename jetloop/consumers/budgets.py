"""Budgets: a turn whose next model call would pass its agent's cap is not called again.

Before each model call the step adds up what the turn has used (``TurnRecord.spent``: every
answered call of the turn, the attempts a crash made repeat included — a resumed step adds
the lost attempt's call from the usage ledger before it claims), what the session's ended
turns used (``SessionRecord.spent``), and what the call about to be made would read (the
adapter's estimate of the request's input tokens, priced as input). If that passes a cap of
``Limits.turn_budget`` or ``Limits.session_budget``, the turn fails with a reason that starts
``budget:``; the user reads it where every turn error is shown and the model of the session's
next turn reads it in a note. The check is made against durable counts, so a crash never
resets it; one call's output is what it cannot know in advance, so a turn can pass its cap
by at most one answer. A compaction's summary call is in the ledger, not in these counts.
"""

from __future__ import annotations

from jetloop.agents.agent import Budget, Limits
from jetloop.schemas import Spent

BUDGET = "budget: "


def is_budget(error: str | None) -> bool:
    return bool(error) and str(error).startswith(BUDGET)


def over_budget(
    limits: Limits, turn: Spent, session: Spent, next_tokens: int, next_cost: float | None
) -> str | None:
    """The reason the next model call may not be made, or None when it may."""
    whole = session.add(turn)
    for name, cap, used in (
        ("turn", limits.turn_budget, turn),
        ("session", limits.session_budget, whole),
    ):
        reason = _passed(name, cap, used, next_tokens, next_cost)
        if reason is not None:
            return reason
    return None


def _passed(
    name: str, cap: Budget | None, used: Spent, next_tokens: int, next_cost: float | None
) -> str | None:
    if cap is None:
        return None
    if cap.tokens is not None and used.tokens + next_tokens > cap.tokens:
        return (
            f"{BUDGET}the {name}'s cap of {cap.tokens} tokens would be passed: "
            f"{used.tokens} used in {used.calls} model call(s), and the next one reads "
            f"about {next_tokens}"
        )
    if cap.cost_usd is not None and used.cost_usd + (next_cost or 0.0) > cap.cost_usd:
        return (
            f"{BUDGET}the {name}'s cap of ${cap.cost_usd:.4f} would be passed: "
            f"${used.cost_usd:.4f} used in {used.calls} model call(s), and the next one costs "
            f"about ${next_cost or 0.0:.4f}"
        )
    return None
