"""Typed outcomes a step handler raises; ``jetloop.consumers.dispatch`` maps each to a message fate.

    StepOutcome
     ├── RetryLater(delay)   → nak with delay: the work is not done, try again later
     ├── TakenOver(key)      → nothing at all: another attempt owns the step (rule 2)
     └── DeadLetter(reason)  → copy to jl.dead.<subject> with the reason, then term

A handler that returns normally has committed what it had to: the message is acked.
Any other exception is a bug or an outage: logged, and the message is nak'd with backoff.
"""

from __future__ import annotations


class StepOutcome(Exception):
    """Base of the outcomes a handler raises to decide its message's fate."""


class RetryLater(StepOutcome):
    def __init__(self, delay: float, reason: str = "") -> None:
        super().__init__(reason or f"retry in {delay}s")
        self.delay = delay
        self.reason = reason


class TakenOver(StepOutcome):
    def __init__(self, key: str) -> None:
        super().__init__(f"taken over: state key {key} was written by another attempt")
        self.key = key


class DeadLetter(StepOutcome):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class StaleCarry(Exception):
    """A step's first write from the revision its message carried (``schemas.Carried``) found
    the record written since: nothing was written, and the step starts again from what it
    reads. Raised and caught inside the handler; never a message's fate."""

    def __init__(self, key: str) -> None:
        super().__init__(f"state key {key} changed since the step's message was published")
        self.key = key
