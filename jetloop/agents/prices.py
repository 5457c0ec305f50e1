"""What a model call costs: a price per model, and the cost of one call's token usage.

Prices are US dollars per million tokens, for input, output and cached input (input the
provider read from its prompt cache). ``DEFAULT_PRICES`` is a small table of list prices as
published when this release was made; ``JETLOOP_PRICES`` (a JSON map of model name to
``{"input": …, "output": …, "cached_input": …}``) adds models or overrides these. A model is
found by its exact name, else by the longest name in the table that it starts with (a dated
variant, ``gpt-4o-mini-2024-07-18``, is priced as ``gpt-4o-mini``), else it is unpriced: its
tokens are counted and its cost is null, never guessed.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

PER = 1_000_000


class Price(BaseModel):
    """US dollars per million tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    input: float = Field(ge=0)
    output: float = Field(ge=0)
    # Cached input tokens are billed at this price instead of ``input`` (null: as input).
    cached_input: float | None = Field(None, ge=0)


DEFAULT_PRICES: dict[str, Price] = {
    "gpt-4o-mini": Price(input=0.15, output=0.60, cached_input=0.075),
    "gpt-4o": Price(input=2.50, output=10.00, cached_input=1.25),
    "gpt-4.1": Price(input=2.00, output=8.00, cached_input=0.50),
    "gpt-4.1-mini": Price(input=0.40, output=1.60, cached_input=0.10),
    "gpt-4.1-nano": Price(input=0.10, output=0.40, cached_input=0.025),
    "o4-mini": Price(input=1.10, output=4.40, cached_input=0.275),
    "claude-sonnet-4-5": Price(input=3.00, output=15.00, cached_input=0.30),
    "claude-haiku-4-5": Price(input=1.00, output=5.00, cached_input=0.10),
    "claude-opus-4-1": Price(input=15.00, output=75.00, cached_input=1.50),
}


class Prices:
    """The price table a worker charges model calls by (defaults, then the overrides)."""

    def __init__(self, overrides: Mapping[str, Price] | None = None) -> None:
        self.table = {**DEFAULT_PRICES, **(overrides or {})}
        # Longest first: the most specific name that a model's name starts with wins.
        self._prefixes = sorted(self.table, key=len, reverse=True)

    def of(self, model: str | None) -> Price | None:
        if not model:
            return None
        name = model.rpartition(":")[2]  # a spec's provider prefix (``openai:gpt-4o``)
        price = self.table.get(name)
        if price is not None:
            return price
        return next((self.table[p] for p in self._prefixes if name.startswith(p)), None)

    def cost(self, model: str | None, usage: Mapping[str, int]) -> float | None:
        """The US dollars ``usage`` costs on ``model``; None when the model has no price."""
        price = self.of(model)
        if price is None:
            return None
        cached = int(usage.get("cached_input_tokens", 0))
        fresh = max(0, int(usage.get("input_tokens", 0)) - cached)
        cached_price = price.input if price.cached_input is None else price.cached_input
        out = int(usage.get("output_tokens", 0))
        return round((fresh * price.input + cached * cached_price + out * price.output) / PER, 9)
