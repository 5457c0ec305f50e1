"""One handler per step kind: the crash semantics live here.

``route`` maps a delivered message to its handler by stream and kind; ``dispatch`` decides
its fate from what the handler raised.
"""

from jetloop.consumers.calls import TOOL_CALL_NOT_RUN_ERROR_PREFIX
from jetloop.consumers.dispatch import dispatch
from jetloop.consumers.errors import DeadLetter, RetryLater, StepOutcome, TakenOver
from jetloop.consumers.faults import Faults
from jetloop.consumers.router import route_step, route_turn
from jetloop.consumers.runtime import Delivery, Runtime

__all__ = [
    "TOOL_CALL_NOT_RUN_ERROR_PREFIX",
    "DeadLetter",
    "Delivery",
    "Faults",
    "RetryLater",
    "Runtime",
    "StepOutcome",
    "TakenOver",
    "dispatch",
    "route_step",
    "route_turn",
]
