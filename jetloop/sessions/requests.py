"""One request model per decision: approve, reject, answer, cancel, reconcile, approval policy.

Each model is the decision's one description, read by everyone who carries it: the Python
client builds it and either runs it (``run``, with the seal key) or sends its JSON on
``jl.control.<op>``; the control service (``jetloop.services.control``) parses that JSON into
it; the gateway builds it from the path, the body and the token, and derives its request body
(and the OpenAPI document's) from its fields. ``DECISIONS`` lists them by op, so a new
decision is one model here and one line there (docs/design.md: each fact in one place).

The JSON is the ``jl.control.<op>`` wire (docs/protocol.md, docs/schemas): lax like every
control request, unknown fields ignored, ``by`` defaulting to ``nats`` when a NATS caller
does not say who decides.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, ClassVar, Generic, TypeVar, cast

from pydantic import AfterValidator, BaseModel

from jetloop.schemas import ApprovalRecord, CallRecord, QuestionRecord, SessionRecord, TurnRecord
from jetloop.schemas.errors import ControlError
from jetloop.schemas.ids import validate_name
from jetloop.sessions.decisions import Control

# Covariant: a decision returning an ApprovalRecord is a decision returning a record.
R = TypeVar("R", bound=BaseModel, covariant=True)

# A session id as every subject and key holds it: a request naming another is refused.
SessionId = Annotated[str, AfterValidator(functools.partial(validate_name, "session id"))]


class DecisionRequest(BaseModel, Generic[R]):
    """A decision: ``op`` names it on the wire (``jl.control.<op>``), ``record`` is what it
    returns (the record as it stands after it), ``run`` does it."""

    op: ClassVar[str]
    record: ClassVar[type[BaseModel]]
    # Only the workers' role may make it (the store's credential: ``jetloop up``'s processes
    # and local commands): the server lets no other credential publish its subject
    # (``jetloop.services.natsauth``), the control service refuses it from them, and the
    # gateway does not serve it.
    privileged: ClassVar[bool] = False

    async def run(self, control: Control) -> R:
        raise NotImplementedError

    def recorded(self, data: Any) -> R:
        """The record a reply's ``result`` holds."""
        return cast(R, self.record.model_validate(data))


class _ApprovalDecision(DecisionRequest[ApprovalRecord]):
    record = ApprovalRecord
    approve: ClassVar[bool]

    session_id: SessionId
    approval_id: str
    by: str = "nats"
    reason: str | None = None

    async def run(self, control: Control) -> ApprovalRecord:
        return await control.decide(
            self.session_id, self.approval_id, self.approve, self.by, self.reason
        )


class ApproveRequest(_ApprovalDecision):
    """Approve a held call; the first decision wins."""

    op = "approve"
    approve = True


class RejectRequest(_ApprovalDecision):
    """Reject a held call: the model sees it denied, with the reason."""

    op = "reject"
    approve = False


class AnswerRequest(DecisionRequest[QuestionRecord]):
    """Answer the model's question; the first answer wins."""

    op = "answer"
    record = QuestionRecord

    session_id: SessionId
    question_id: str
    answer: str
    by: str = "nats"

    async def run(self, control: Control) -> QuestionRecord:
        return await control.answer(self.session_id, self.question_id, self.answer, self.by)


class CancelRequest(DecisionRequest[TurnRecord]):
    """Cancel a turn: the given one, or the session's running turn."""

    op = "cancel"
    record = TurnRecord

    session_id: SessionId
    turn_id: str | None = None
    by: str = "nats"

    async def run(self, control: Control) -> TurnRecord:
        return await control.cancel(self.session_id, self.turn_id, self.by)


class ReconcileRequest(DecisionRequest[CallRecord]):
    """Settle an outcome_unknown call as succeeded (with a result) or failed."""

    op = "reconcile"
    record = CallRecord

    call_key: str
    succeeded: bool
    result: Any = None
    error: str | None = None
    by: str = "nats"

    async def run(self, control: Control) -> CallRecord:
        return await control.reconcile(
            self.call_key, self.succeeded, self.by, self.result, self.error
        )


class ApprovalPolicyRequest(DecisionRequest[SessionRecord]):
    """Require (true) or waive (false) approval of a tool in one session; null removes the
    override. With an agent, a session that does not exist yet is created for it. Audited
    (who, when, from what) and privileged: waiving approval is not a client's to do."""

    op = "approval_policy"
    record = SessionRecord
    privileged = True

    session_id: SessionId
    tool: str
    required: bool | None
    agent: str | None = None
    by: str = "nats"

    async def run(self, control: Control) -> SessionRecord:
        return await control.set_approval(
            self.session_id, self.tool, self.required, self.agent, self.by
        )


# Every decision by its op: the control service serves these subjects, a test holds the
# client and the gateway to it.
DECISIONS: dict[str, type[DecisionRequest[Any]]] = {
    m.op: m
    for m in (
        ApproveRequest,
        RejectRequest,
        AnswerRequest,
        CancelRequest,
        ReconcileRequest,
        ApprovalPolicyRequest,
    )
}
# The decisions only the workers' role may make (``DecisionRequest.privileged``).
PRIVILEGED = frozenset(op for op, m in DECISIONS.items() if m.privileged)


def refused(op: str, who: str) -> ControlError:
    """The refusal of privileged decision ``op`` made as identity ``who``: it names who may."""
    return ControlError(
        403,
        "not allowed",
        f"{op} needs the workers' role (the store's credential, which jetloop up and the "
        f"local CLI beside its store use); {who!r} does not have it",
    )
