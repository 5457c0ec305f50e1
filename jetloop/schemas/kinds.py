"""The kinds of step, and what each one is on the wire: its pool and the shape of its key.

This is the wire's half of the one description of a step kind (``docs/design.md``, "Step
kinds"); the engine's half, the handler of each kind, is ``jetloop.consumers.router``. Both
are written as a ``match`` ending in ``assert_never``, so the type checker names a kind left
out, and both are built over every ``StepKind`` when imported, so nothing reads a partial one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum, StrEnum
from types import MappingProxyType
from typing import Final, assert_never


class StepKind(StrEnum):
    RUN_MODEL = "run_model"
    CALL_TOOL = "call_tool"
    CALL_SINGLE_ATTEMPT_TOOL = "call_single_attempt_tool"
    CALL_TOOLS = "call_tools"  # every call a model step asked for, in one message
    AWAIT_TOOL_APPROVAL = "await_tool_approval"
    AWAIT_QUESTION_ANSWER = "await_question_answer"
    AWAIT_TIMER = "await_timer"
    POLL_TOOL_TASK = "poll_tool_task"
    AWAIT_DELEGATION = "await_delegation"
    COMPACT_CONTEXT = "compact_context"
    JOIN = "join"
    TURN_DONE = "turn_done"
    CLOSE_TURN = "close_turn"  # a cancelled or failed turn: settle its open calls


# The most calls one ``call_tools`` message carries: a model step that asks for more sends a
# message per call (as every model step did before there was ``call_tools``).
CALLS_PER_MESSAGE = 64


class Pool(StrEnum):
    """The workers a step goes to (``jl.step.<pool>.…``): a worker may serve some pools only,
    so a model step never waits behind a slow tool."""

    SESSION = "session"
    MODEL = "model"
    TOOL = "tool"


class Scope(Enum):
    """What one step of a kind is about; its key starts with that thing's identity."""

    TURN = "turn"  # <session>.<turn>
    MODEL_STEP = "model_step"  # <session>.<turn>.m<n>
    CALL = "call"  # <session>.<turn>.m<n>.c<i>


@dataclass(frozen=True)
class KindWire:
    """A kind on the wire: the pool its subject names, and its key (``Nats-Msg-Id``): the
    scope's identity, then ``.<suffix>`` if it has one (then ``.<wake>`` if the step has one)."""

    pool: Pool
    scope: Scope
    suffix: str = ""


def _wire(kind: StepKind) -> KindWire:
    # A match, not a dict literal, so that mypy reports a kind without its row.
    match kind:
        case StepKind.RUN_MODEL:
            return KindWire(Pool.MODEL, Scope.MODEL_STEP)
        case StepKind.COMPACT_CONTEXT:
            return KindWire(Pool.MODEL, Scope.MODEL_STEP, "compact")
        case StepKind.CALL_TOOL | StepKind.CALL_SINGLE_ATTEMPT_TOOL:
            # One key for both: a call is made one way or the other, never both.
            return KindWire(Pool.TOOL, Scope.CALL)
        case StepKind.CALL_TOOLS:
            return KindWire(Pool.TOOL, Scope.MODEL_STEP, "calls")
        case StepKind.AWAIT_TOOL_APPROVAL:
            return KindWire(Pool.TOOL, Scope.CALL, "approval")
        case StepKind.AWAIT_QUESTION_ANSWER:
            return KindWire(Pool.TOOL, Scope.CALL, "answer")
        case StepKind.AWAIT_TIMER:
            return KindWire(Pool.TOOL, Scope.CALL, "timer")
        case StepKind.POLL_TOOL_TASK:
            return KindWire(Pool.TOOL, Scope.CALL, "poll")
        case StepKind.AWAIT_DELEGATION:
            return KindWire(Pool.TOOL, Scope.CALL, "child")
        case StepKind.JOIN:
            return KindWire(Pool.SESSION, Scope.CALL, "join")
        case StepKind.TURN_DONE:
            return KindWire(Pool.SESSION, Scope.TURN, "done")
        case StepKind.CLOSE_TURN:
            return KindWire(Pool.SESSION, Scope.TURN, "close")
        case _:
            assert_never(kind)


WIRE_OF_KIND: Final[Mapping[StepKind, KindWire]] = MappingProxyType({k: _wire(k) for k in StepKind})
