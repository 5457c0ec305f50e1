"""The HTTP API's shapes (pydantic models) and its OpenAPI 3.1 document.

The request models validate what the gateway reads; their JSON Schemas are the request
bodies and query parameters of the document, so the two cannot drift apart. A decision's
body is derived from its request model (``jetloop.sessions.requests``, ``body_of``), the one
the client sends and the control service parses. The paths are
written out here by hand and a test compares them (paths, methods, scopes) with the
gateway's router. Every operation that needs a scope takes ``?namespace=`` (``NAMESPACE``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic.fields import FieldInfo
from pydantic.json_schema import models_json_schema
from pydantic_core import PydanticCustomError

from jetloop.schemas import ApprovalRecord, CallRecord, QuestionRecord, TurnRecord
from jetloop.services.namespaces import NAME_RULE
from jetloop.sessions.requests import (
    AnswerRequest,
    ApprovalPolicyRequest,
    ApproveRequest,
    CancelRequest,
    DecisionRequest,
    ReconcileRequest,
    RejectRequest,
)
from jetloop.sessions.snapshot import SessionSnapshot
from jetloop.sessions.turns import TurnDetail, TurnPage

NAME = r"^[A-Za-z0-9_-]{1,64}$"
CALL_KEY = r"^[A-Za-z0-9_-]{1,64}(\.[A-Za-z0-9_-]{1,64}){3}$"
REQUEST_ID = r"^[\x21-\x7e]{1,200}$"  # printable ASCII, no spaces: a header value
SEQ = r"^[0-9]{1,18}$"  # fits SQLite's integers
ASSET = r"^[a-z0-9_-]{1,64}\.(js|css|txt|svg)$"


class Body(BaseModel):
    # JSON bodies are strict: `"approve": "yes"` is a mistake, not a yes.
    model_config = ConfigDict(strict=True, extra="forbid")


class Decision(Body):
    """A body whose author is recorded: the author is the token's name, never a field."""

    @model_validator(mode="before")
    @classmethod
    def _no_by(cls, data: Any) -> Any:
        if isinstance(data, dict) and "by" in data:
            raise PydanticCustomError(
                "by_not_accepted",
                "`by` is not accepted: who decides is the name of the request's token",
            )
        return data


class MessageIn(Body):
    text: str = Field(min_length=1, description="the user's message")


def body_of(
    request: type[DecisionRequest[Any]],
    name: str,
    path: tuple[str, ...],
    bounds: dict[str, FieldInfo],
    first: dict[str, Any] | None = None,
) -> type[Decision]:
    """The HTTP body of a decision: the fields of its request model
    (``jetloop.sessions.requests``) less the ones the ``path`` gives and ``by`` (the token's
    name), strict, with the gateway's ``bounds`` on what a stranger may send; ``first``: fields
    of the route's own, before them."""
    fields: dict[str, Any] = dict(first or {})
    unknown = (set(path) | set(bounds)) - set(request.model_fields)
    if unknown:
        raise ValueError(f"{request.__name__} has no field {sorted(unknown)}")
    for field, info in request.model_fields.items():
        if field in path or field == "by":
            continue
        if field in bounds:
            info = FieldInfo.merge_field_infos(info, bounds[field])
        fields[field] = (info.annotation, info)
    body: type[Decision] = create_model(name, __base__=Decision, **fields)
    return body


# One route serves both approval decisions: ``approve`` in the body picks the request.
DecisionIn = body_of(
    ApproveRequest,
    "DecisionIn",
    ("session_id", "approval_id"),
    {"reason": Field(max_length=4000)},
    first={"approve": (bool, ...)},
)
AnswerIn = body_of(
    AnswerRequest,
    "AnswerIn",
    ("session_id", "question_id"),
    {"answer": Field(max_length=100_000)},
)
ReconcileIn = body_of(
    ReconcileRequest, "ReconcileIn", ("call_key",), {"error": Field(max_length=4000)}
)
CancelIn = body_of(
    CancelRequest,
    "CancelIn",
    ("session_id",),
    {"turn_id": Field(pattern=NAME, description="default: the running turn")},
)

# The decisions the gateway serves: op -> (the route's operationId, its body). Setting an
# approval policy is not on HTTP (the CLI, the Python client and NATS set it).
HTTP_DECISIONS: dict[str, tuple[str, type[Decision]]] = {
    ApproveRequest.op: ("decideApproval", DecisionIn),
    RejectRequest.op: ("decideApproval", DecisionIn),
    AnswerRequest.op: ("answerQuestion", AnswerIn),
    CancelRequest.op: ("cancelTurn", CancelIn),
    ReconcileRequest.op: ("reconcileCall", ReconcileIn),
}
NOT_ON_HTTP = frozenset({ApprovalPolicyRequest.op})


class Query(BaseModel):
    # Query strings are text: lax parsing turns "true" and "10" into what they say.
    model_config = ConfigDict(extra="ignore")


class MessageQuery(Query):
    wait: bool = Field(False, description="wait for the turn to end and return its answer")
    timeout: float = Field(
        30.0, gt=0, le=3600, description="seconds to wait (capped by the gateway's maximum)"
    )


class SnapshotQuery(Query):
    history_offset: int = Field(0, ge=0, le=1_000_000_000)
    history_limit: int = Field(50, ge=1, le=500)


class TurnsQuery(Query):
    limit: int = Field(50, ge=1, le=1000, description="turns in the page, newest first")
    offset: int = Field(0, ge=0, le=1_000_000_000)


class TurnQuery(Query):
    calls_limit: int = Field(1000, ge=1, le=1000, description="calls at most (in order)")


class ListQuery(Query):
    q: str | None = Field(None, max_length=200, description="search ids, agents and texts")
    status: Literal["idle", "running", "waiting", "approval", "answer", "failed"] | None = Field(
        None,
        description="idle, running, waiting (anything); approval or answer (waits for a "
        "person); failed (the last turn failed)",
    )
    agent: str | None = Field(None, max_length=64)
    limit: int = Field(50, ge=1, le=200)
    offset: int = Field(0, ge=0, le=1_000_000_000)


class TurnOut(BaseModel):
    agent: str
    session_id: str
    turn_id: str
    request_id: str
    duplicate: bool
    status: Literal["accepted", "pending", "queued", "running", "completed", "failed", "cancelled"]
    text: str | None = None
    error: str | None = None


class HookOut(TurnOut):
    trigger: str
    webhook_id: str


class SessionRow(BaseModel):
    session_id: str
    agent: str | None = None
    status: str | None = None
    created_at: float | None = None
    updated_at: float | None = None
    last_turn_id: str | None = None
    turns_total: int = 0
    turns_completed: int = 0
    turns_failed: int = 0
    turns_cancelled: int = 0
    pending_approvals: int = 0
    open_questions: int = 0
    last_text: str | None = None
    last_answer: str | None = None
    last_seq: int = 0
    last_turn_status: str | None = None
    # approval, answer, timer, task: the calls of the running turn wait for these;
    # worker: the session is busy and no live worker serves its agent
    waiting_for: list[str] = Field(default_factory=list)


class SessionList(BaseModel):
    total: int
    limit: int
    offset: int
    sessions: list[SessionRow]


class PageQuery(Query):
    limit: int = Field(50, ge=1, le=200)
    offset: int = Field(0, ge=0, le=1_000_000_000)


class TimelineQuery(Query):
    after: int = Field(0, ge=0, description="events after this stream sequence")
    limit: int = Field(500, ge=1, le=1000, description="events in the page, in log order")


class DeadQuery(Query):
    before: int | None = Field(None, ge=1, description="letters before this JL_DEAD sequence")
    limit: int = Field(20, ge=1, le=100, description="letters in the page, newest first")


class Whoami(BaseModel):
    name: str
    scopes: list[str]


class NamespaceList(BaseModel):
    # The first is the one a request that names none acts in.
    namespaces: list[str]
    current: str  # the one this request acted in


class InboxItem(BaseModel):
    kind: Literal["approval", "question"]
    session_id: str
    id: str  # the approval id or the question id
    turn_id: str | None = None
    call_key: str | None = None
    tool: str | None = None
    args: Any = None
    question: str | None = None
    at: float | None = None


class Inbox(BaseModel):
    total: int
    limit: int
    offset: int
    items: list[InboxItem]


class TimelineEvent(BaseModel):
    seq: int
    key: str
    type: str
    at: float
    data: Any = None
    # The data was cut (larger than the gateway sends in a page): GET the event for it.
    truncated: bool = False
    size: int = 0


class TimelineCall(BaseModel):
    call_key: str
    model_step: int | None = None
    call_index: int | None = None
    tool: str | None = None
    effect: str | None = None
    state: str | None = None
    attempts: int | None = None
    idempotency_key: str | None = None
    error: str | None = None
    settlement: str | None = None
    approval_id: str | None = None
    question_id: str | None = None
    timer_due: float | None = None
    reconciled_by: str | None = None
    updated_at: float | None = None


class Timeline(BaseModel):
    session_id: str
    turn_id: str
    turn: dict[str, Any] | None = None
    calls: list[TimelineCall]
    events: list[TimelineEvent]
    # Pass as ``after`` for the next page (null: this was the last one).
    next_after: int | None = None


class DeadLetter(BaseModel):
    seq: int
    time: str | None = None
    subject: str  # where it was published first
    stream: str | None = None
    stream_seq: str | None = None
    reason: str
    body: Any = None
    truncated: bool = False
    size: int = 0


class DeadLetters(BaseModel):
    total: int
    letters: list[DeadLetter]
    next_before: int | None = None


class WorkerRow(BaseModel):
    worker_id: str
    agents: list[str]
    pools: list[str]
    since: float
    release: str | None = None  # its jetloop release; None: one before 0.2.0
    reads: int = 1  # the highest schema version it reads


class ConsumerRow(BaseModel):
    stream: str
    name: str
    pending: int  # the lag: messages not yet delivered
    ack_pending: int
    redelivered: int


class StreamRow(BaseModel):
    name: str
    messages: int
    bytes: int
    last_seq: int


class UsageQuery(Query):
    session: str | None = Field(None, pattern=NAME, description="one session's calls")
    turn: str | None = Field(None, pattern=NAME, description="one turn's calls (with session)")
    agent: str | None = Field(None, pattern=NAME, description="one agent's calls")
    day: str | None = Field(
        None, pattern=r"^\d{4}-\d{2}-\d{2}$", description="one UTC day's calls, YYYY-MM-DD"
    )
    by: Literal["turn", "session", "agent", "model", "day"] = Field(
        "session", description="what to total by"
    )


class UsageTotals(BaseModel):
    """What a group of model calls used; ``cost_usd`` is null when one of them has no price
    (``priced_cost_usd`` then sums the others)."""

    calls: int
    input_tokens: int  # cached ones included
    output_tokens: int
    cached_input_tokens: int
    tokens: int  # input + output
    cost_usd: float | None  # every call's cost; null when any is unpriced (never a guess)
    priced_cost_usd: float  # the priced calls' cost
    unpriced_calls: int  # calls of a model without a price (tokens counted, no cost)
    models: list[str]


class UsageGroup(UsageTotals):
    group: str


class Usage(BaseModel):
    """The usage ledger's totals: every model call that got an answer, every attempt."""

    by: str
    total: UsageTotals
    groups: list[UsageGroup]


class Operations(BaseModel):
    workers: list[WorkerRow]
    agents: list[str]
    consumers: list[ConsumerRow]
    streams: list[StreamRow]
    readmodel_position: int | None = None


class Health(BaseModel):
    status: str
    missing: list[str] = Field(default_factory=list)


class Problem(BaseModel):
    """RFC 9457 problem details."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    errors: list[dict[str, Any]] | None = None


SCHEMA_MODELS: list[type[BaseModel]] = [
    TurnOut,
    HookOut,
    SessionList,
    SessionSnapshot,
    TurnPage,
    TurnDetail,
    ApprovalRecord,
    QuestionRecord,
    CallRecord,
    TurnRecord,
    Health,
    Problem,
    Whoami,
    NamespaceList,
    Inbox,
    Timeline,
    TimelineEvent,
    DeadLetters,
    DeadLetter,
    Operations,
    Usage,
]


def _inline(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    schema.pop("title", None)
    return schema


def _query(model: type[BaseModel]) -> list[dict[str, Any]]:
    out = []
    for name, prop in _inline(model)["properties"].items():
        prop = dict(prop)
        # An optional parameter is one that is left out, not one that is null.
        if "anyOf" in prop:
            kinds = [k for k in prop.pop("anyOf") if k.get("type") != "null"]
            prop.update(kinds[0] if len(kinds) == 1 else {"anyOf": kinds})
        desc = prop.pop("description", None)
        prop.pop("title", None)
        if prop.get("default", 0) is None:
            prop.pop("default")
        p: dict[str, Any] = {"name": name, "in": "query", "required": False, "schema": prop}
        if desc:
            p["description"] = desc
        out.append(p)
    return out


def _path(name: str, pattern: str = NAME) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": pattern},
    }


def _header(name: str, description: str, pattern: str | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    if pattern:
        schema["pattern"] = pattern
    return {
        "name": name,
        "in": "header",
        "required": False,
        "description": description,
        "schema": schema,
    }


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


PROBLEMS = {
    "400": "bad request",
    "401": "no token, or an unknown one",
    "403": "the token lacks the scope or the namespace, or (without a token) a page of another "
    "origin sent it",
    "404": "not found",
    "408": "the request body did not arrive within the body deadline",
    "409": "conflict with the current state",
    "413": "request body too large",
    "415": "the body is not application/json",
    "421": "without a token: the Host is not this gateway's loopback address",
    "422": "invalid request",
    "429": "this address sent too many unknown tokens: try again after Retry-After (the "
    "token was not looked at)",
    "503": "NATS or the read model is not available, state cannot be verified, the namespace "
    "is not served by this gateway, the gateway is stopping, or too many connections are "
    "open (Retry-After)",
    "507": "the namespace is at its storage limit (or the server's disk is full): nothing "
    "more is stored until its queue drains or the limit is raised",
}


NAMESPACE = {
    "name": "namespace",
    "in": "query",
    "required": False,
    "description": f"the namespace to act in ({NAME_RULE}), one the token holds (a 403 "
    "otherwise, whether it exists or not); default: the token's first, `default` when it "
    "holds it",
    "schema": {"type": "string", "pattern": r"^[a-z0-9][a-z0-9_-]{0,39}$"},
}


# What whole kinds of operations may answer besides what each does itself: the layers every
# request passes through (``jetloop.services.gateway``: ``guard``, ``browser``, ``http``,
# ``state``). One table, read by ``_op`` and by the test that provokes each status on every
# operation of its kind (tests/test_openapi_statuses.py).
ANSWERED_BY_KIND: dict[str, tuple[str, ...]] = {
    # guard: one connection more than max_connections, before a byte is read
    "every": ("503",),
    # browser_rules: without tokens, a Host that is not this gateway (a webhook is judged by
    # its signature instead)
    "unsigned": ("421",),
    # auth, guarded, in_namespace, and a namespace not served (or the gateway stopping)
    "scoped": ("401", "403", "429", "503"),
    # body_deadline, and aiohttp's client_max_size
    "with body": ("408", "413"),
    # json_writes: a write's body to a route with a scope
    "scoped with body": ("415",),
}


def kinds(scope: str | None, signed: bool, has_body: bool) -> list[str]:
    """The kinds (``ANSWERED_BY_KIND``) of an operation."""
    out = ["every"]
    if not signed:
        out.append("unsigned")
    if scope:
        out.append("scoped")
    if has_body:
        out.append("with body")
        if scope:
            out.append("scoped with body")
    return out


def _op(
    op_id: str,
    summary: str,
    scope: str | None,
    ok: dict[str, dict[str, Any]],
    *,
    params: list[dict[str, Any]] | None = None,
    body: type[BaseModel] | None = None,
    body_required: bool = True,
    any_body: bool = False,
    problems: tuple[str, ...] = ("400", "404", "422"),
    signed: bool = False,
    conflict: str | None = None,
) -> dict[str, Any]:
    """One operation; ``conflict`` says what its 409 means when it has a meaning of its own;
    ``any_body``: a body of any type, taken as it comes (a webhook's)."""
    responses: dict[str, Any] = dict(ok)
    errs = list(problems)
    for kind in kinds(scope, signed, body is not None or any_body):
        errs += ANSWERED_BY_KIND[kind]
    for code in sorted(set(errs)):
        responses[code] = {
            "description": PROBLEMS[code],
            "content": {"application/problem+json": {"schema": _ref("Problem")}},
        }
    if conflict is not None:
        responses["409"]["description"] = conflict
    op: dict[str, Any] = {
        "operationId": op_id,
        "summary": summary,
        "security": [{"bearerAuth": [scope]}] if scope else [],
        "responses": responses,
    }
    if scope:
        params = [*(params or []), NAMESPACE]
    if params:
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = {
            "required": body_required,
            "content": {"application/json": {"schema": _inline(body)}},
        }
    elif any_body:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {}}, "*/*": {"schema": {}}},
        }
    return op


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the gateway (served at ``GET /v1/openapi.json``)."""
    _, defs = models_json_schema(
        [(m, "serialization") for m in SCHEMA_MODELS],
        ref_template="#/components/schemas/{model}",
    )
    session = _path("session")
    idem = _header(
        "Idempotency-Key",
        "the request id (the turn request is sent with Nats-Msg-Id <session>.<request id>): "
        "a resend with the same key starts no second turn",
        REQUEST_ID,
    )
    last_id = _header(
        "Last-Event-ID", "resume after this stream sequence (sent by EventSource)", r"^[0-9]+$"
    )
    hook_headers = [
        _header(h, "Standard Webhooks")
        for h in ("webhook-id", "webhook-timestamp", "webhook-signature")
    ] + [
        _header(h, "GitHub") for h in ("X-Hub-Signature-256", "X-GitHub-Delivery", "X-GitHub-Event")
    ]
    turn = _ref("TurnOut")
    paths: dict[str, Any] = {
        "/v1/agents/{agent}/sessions/{session}/messages": {
            "post": _op(
                "sendMessage",
                "Send a user message: starts (or queues) a turn",
                "write",
                {
                    "202": _json(turn, "accepted (or still running after the wait)"),
                    "200": _json(turn, "the turn ended (with ?wait=true)"),
                },
                params=[_path("agent"), session, idem, *_query(MessageQuery)],
                body=MessageIn,
                problems=("400", "404", "422", "507"),
            )
        },
        "/v1/sessions": {
            "get": _op(
                "listSessions",
                "List and search sessions (from the read model)",
                "read",
                {"200": _json(_ref("SessionList"), "a page of sessions")},
                params=_query(ListQuery),
                problems=("422", "503"),
            )
        },
        "/v1/sessions/{session}": {
            "get": _op(
                "getSession",
                "The session's snapshot: status, history page, turn, calls, waits, queue",
                "read",
                {"200": _json(_ref("SessionSnapshot"), "the snapshot")},
                params=[session, *_query(SnapshotQuery)],
            )
        },
        "/v1/sessions/{session}/turns": {
            "get": _op(
                "listTurns",
                "The session's turns, newest first: request id, status, model step, calls, error",
                "read",
                {"200": _json(_ref("TurnPage"), "a page of turns")},
                params=[session, *_query(TurnsQuery)],
                problems=("400", "404", "422", "503"),
            )
        },
        "/v1/sessions/{session}/turns/{turn_id}": {
            "get": _op(
                "getTurn",
                "One turn: its record and its calls (every model step's) with their outcomes",
                "read",
                {"200": _json(_ref("TurnDetail"), "the turn and its calls")},
                params=[session, _path("turn_id"), *_query(TurnQuery)],
                problems=("400", "404", "422", "503"),
            )
        },
        "/v1/sessions/{session}/events": {
            "get": _op(
                "streamEvents",
                "Server-Sent Events of the session's log; resumable by Last-Event-ID",
                "read",
                {
                    "200": {
                        "description": "an event stream: id is the JL_EVENTS sequence",
                        "content": {"text/event-stream": {"schema": {"type": "string"}}},
                    }
                },
                params=[
                    session,
                    last_id,
                    {
                        "name": "after",
                        "in": "query",
                        "required": False,
                        "description": "resume after this sequence (when no Last-Event-ID)",
                        "schema": {"type": "integer", "minimum": 0},
                    },
                ],
            )
        },
        "/v1/sessions/{session}/approvals/{approval_id}": {
            "post": _op(
                "decideApproval",
                "Approve or reject a held call; the first decision wins",
                "approve",
                {"200": _json(_ref("ApprovalRecord"), "the recorded decision (also on a repeat)")},
                params=[session, _path("approval_id")],
                body=DecisionIn,
                problems=("400", "404", "409", "422"),
                conflict="decided otherwise already (the detail names the decision and who "
                "made it), or the record is not trusted; nothing changed",
            )
        },
        "/v1/sessions/{session}/questions/{question_id}": {
            "post": _op(
                "answerQuestion",
                "Answer the model's question; the first answer wins",
                "write",
                {"200": _json(_ref("QuestionRecord"), "the recorded answer (also on a repeat)")},
                params=[session, _path("question_id")],
                body=AnswerIn,
                problems=("400", "404", "409", "422"),
                conflict="answered otherwise already (the detail quotes the answer), or the "
                "record is not trusted; nothing changed",
            )
        },
        "/v1/sessions/{session}/cancel": {
            "post": _op(
                "cancelTurn",
                "Cancel the running turn (or the given one)",
                "write",
                {"200": _json(_ref("TurnRecord"), "the cancelled turn")},
                params=[session],
                body=CancelIn,
                body_required=False,
                problems=("400", "404", "409", "422"),
            )
        },
        "/v1/calls/{call_key}/reconcile": {
            "post": _op(
                "reconcileCall",
                "Settle an outcome_unknown call as succeeded or failed",
                "approve",
                {"200": _json(_ref("CallRecord"), "the settled call")},
                params=[_path("call_key", CALL_KEY)],
                body=ReconcileIn,
                problems=("400", "404", "409", "422"),
            )
        },
        "/v1/hooks/{trigger}": {
            "post": _op(
                "receiveWebhook",
                "An inbound webhook (Standard Webhooks or GitHub signature) starts a turn",
                None,
                {"202": _json(_ref("HookOut"), "accepted (a replayed id is a duplicate)")},
                params=[_path("trigger"), *hook_headers],
                any_body=True,
                problems=("400", "401", "404", "422", "507"),
                signed=True,
            )
        },
        "/v1/whoami": {
            "get": _op(
                "whoami",
                "The token's name and scopes (the console signs in with it)",
                "read",
                {"200": _json(_ref("Whoami"), "who the token is")},
                problems=(),
            )
        },
        "/v1/namespaces": {
            "get": _op(
                "listNamespaces",
                "The namespaces the token acts in, the one a request naming none acts in first",
                "read",
                {"200": _json(_ref("NamespaceList"), "the token's namespaces")},
                problems=("422",),
            )
        },
        "/v1/events": {
            "get": _op(
                "streamAllEvents",
                "Server-Sent Events of every session's log, from now (or after Last-Event-ID)",
                "read",
                {
                    "200": {
                        "description": "an event stream: id is the JL_EVENTS sequence",
                        "content": {"text/event-stream": {"schema": {"type": "string"}}},
                    }
                },
                params=[last_id],
                problems=("400", "503"),
            )
        },
        "/v1/inbox": {
            "get": _op(
                "getInbox",
                "Pending approvals and open questions across sessions, newest first",
                "read",
                {"200": _json(_ref("Inbox"), "a page of the inbox")},
                params=_query(PageQuery),
                problems=("422", "503"),
            )
        },
        "/v1/sessions/{session}/turns/{turn_id}/timeline": {
            "get": _op(
                "getTimeline",
                "A turn's timeline (read model): every event in log order, its calls; large "
                "payloads cut (GET the event for the whole)",
                "read",
                {"200": _json(_ref("Timeline"), "a page of the timeline")},
                params=[session, _path("turn_id"), *_query(TimelineQuery)],
                problems=("404", "422", "503"),
            )
        },
        "/v1/sessions/{session}/events/{seq}": {
            "get": _op(
                "getEvent",
                "One event of the session's log, whole (read model)",
                "read",
                {"200": _json(_ref("TimelineEvent"), "the event")},
                params=[session, _path("seq", SEQ)],
                problems=("404", "422", "503"),
            )
        },
        "/v1/dead-letters": {
            "get": _op(
                "listDeadLetters",
                "Dead letters (JL_DEAD), newest first: where each came from, why, the message",
                "read",
                {"200": _json(_ref("DeadLetters"), "a page of dead letters")},
                params=_query(DeadQuery),
                problems=("422", "503"),
            )
        },
        "/v1/dead-letters/{seq}": {
            "get": _op(
                "getDeadLetter",
                "One dead letter, its message whole",
                "read",
                {"200": _json(_ref("DeadLetter"), "the dead letter")},
                params=[_path("seq", SEQ)],
                problems=("404", "422", "503"),
            )
        },
        "/v1/usage": {
            "get": _op(
                "getUsage",
                "Tokens and cost of model calls (the usage ledger, from the read model)",
                "read",
                {"200": _json(_ref("Usage"), "the totals")},
                params=_query(UsageQuery),
                problems=("422", "503"),
            )
        },
        "/v1/operations": {
            "get": _op(
                "getOperations",
                "Live workers and their agents, consumers and their lag, streams",
                "read",
                {"200": _json(_ref("Operations"), "the figures")},
                problems=("503",),
            )
        },
        "/": {
            "get": _op(
                "console",
                "The web console (its data comes from the routes above, with a token)",
                None,
                {"200": {"description": "the page", "content": {"text/html": {"schema": {}}}}},
                problems=(),
            )
        },
        "/console/{asset}": {
            "get": _op(
                "consoleAsset",
                "The console's script, style and licence files",
                None,
                {"200": {"description": "the file", "content": {"*/*": {"schema": {}}}}},
                params=[_path("asset", ASSET)],
                problems=("404",),
            )
        },
        "/v1/openapi.json": {
            "get": _op(
                "getOpenAPI",
                "This document",
                None,
                {"200": _json({"type": "object"}, "the OpenAPI 3.1 document")},
                problems=(),
            )
        },
        "/healthz": {
            "get": _op(
                "health",
                "The process is up",
                None,
                {"200": _json(_ref("Health"), "up")},
                problems=(),
            )
        },
        "/readyz": {
            "get": _op(
                "ready",
                "NATS is connected and the topology is present",
                None,
                {"200": _json(_ref("Health"), "ready")},
                problems=("503",),
            )
        },
        "/metrics": {
            "get": _op(
                "metrics",
                "Prometheus metrics",
                None,
                {
                    "200": {
                        "description": "text exposition format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
                problems=(),
            )
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "jetloop gateway",
            "version": "1",
            "description": "Durable AI-agent turns on NATS JetStream, over HTTP. Every error "
            "is application/problem+json (RFC 9457).",
        },
        "servers": [{"url": "/"}],
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "tokens are configured with scopes: read, write, approve",
                }
            },
        },
    }
