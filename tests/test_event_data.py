"""An event's ``data`` is built and read through its type's model (``EVENT_DATA``), and the
records' ``model_copy(update=...)`` name only fields their models have.

What the engine really writes in a whole turn is checked against the same models in
``tests/test_wire_schemas.py`` (a real worker and server)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import msgpack
import pytest
from pydantic import BaseModel

import jetloop.schemas.records
import jetloop.services.gateway.config
import jetloop.services.gateway.openapi
import jetloop.services.settings
from jetloop.schemas import (
    EVENT_DATA,
    BlobRef,
    Carried,
    Event,
    EventType,
    HistoryEntry,
    StepMessage,
    encode,
)
from jetloop.schemas.events import (
    AnsweredCall,
    CallOutcomeData,
    EventData,
    ModelAnsweredData,
    TurnCompletedData,
    TurnFailedData,
)
from jetloop.services.readmodel.model import Incoming, ReadModel
from jetloop.streams import topology

JETLOOP = Path(__file__).resolve().parent.parent / "jetloop"


def _sources() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(JETLOOP.rglob("*.py"))]


def test_every_payload_model_names_one_type() -> None:
    """Each data model is the data of exactly one type, so ``Event.of`` can tell the type
    from the model."""
    assert len(set(EVENT_DATA.values())) == len(EVENT_DATA)
    assert all(issubclass(m, EventData) for m in EVENT_DATA.values())


def test_of_writes_the_type_of_the_model_and_every_field() -> None:
    """``Event.of`` takes the type from ``EVENT_DATA`` and writes every field of the model,
    a missing value as nil (as the wire always had it), nested models as maps."""
    failed = Event.of(TurnFailedData(request_id="r"), key="k", session_id="s", turn_id="t")
    assert failed.type == EventType.TURN_FAILED
    assert msgpack.unpackb(encode(failed))["data"] == {"request_id": "r", "error": None}
    done = Event.of(
        TurnCompletedData(request_id="r", text_ref=BlobRef(blob="b", size=3), model_steps=1),
        key="k",
        session_id="s",
        turn_id="t",
    )
    assert done.data == {
        "request_id": "r",
        "text": None,
        "text_ref": {"blob": "b", "size": 3},
        "model_steps": 1,
        "usage": {},
    }
    with pytest.raises(TypeError, match="AnsweredCall is not the data of an event type"):
        Event.of(
            AnsweredCall(call_id="c", tool="t", effect="read"),  # type: ignore[arg-type]
            key="k",
            session_id="s",
            turn_id=None,
        )


def test_the_product_builds_every_event_through_its_model() -> None:
    """No code in ``jetloop/`` writes an event's ``data`` by hand: ``Event(...)`` is never
    given ``data=``; ``Event.of(<the type's model>, ...)`` is the one way."""
    by_hand = [
        f"{path.relative_to(JETLOOP.parent)}:{node.lineno}"
        for path, tree in _sources()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "Event"
        and any(k.arg == "data" for k in node.keywords)
    ]
    assert by_hand == []


def _event(seq: int, etype: EventType, data: dict[str, Any]) -> Incoming:
    ev = Event(key=f"s.t.{seq}", type=etype, session_id="s", turn_id="t", at=float(seq))
    ev.data = data
    return Incoming(seq, topology.event_subject("s", etype.value), encode(ev))


async def test_read_model_reads_data_through_the_models(tmp_path: Path) -> None:
    """The read model ignores fields it does not know (a newer writer's) and projects the
    rest; data its type's model refuses is counted unreadable and written nowhere, not
    even in the audit."""
    answered = ModelAnsweredData(
        model_step=0, calls=[AnsweredCall(call_id="c", tool="read", effect="read")]
    ).model_dump(mode="json")
    outcome = CallOutcomeData(
        call_key="s.t.0.0", tool="read", effect="read", state="succeeded", attempts=1
    ).model_dump(mode="json")
    async with await ReadModel.open(tmp_path / "rm.sqlite") as rm:
        await rm.prepare()
        got = await rm.apply(
            [
                _event(1, EventType.MODEL_ANSWERED, {**answered, "from_the_future": [1, 2]}),
                _event(2, EventType.CALL_OUTCOME, {**outcome, "attempts": "many"}),
                _event(3, EventType.TURN_FAILED, {"error": "no request id"}),
                _event(4, EventType.TASK_POLLED, {"anything": True}),  # reserved: audit only
            ]
        )
        assert (got.applied, got.unreadable) == (2, 2)
        rows = await rm.dump()
    assert [a[5] for a in rows["audit"]] == ["model.answered", "task.polled"]  # (type)
    [call] = rows["calls"]
    assert "read" in call and "succeeded" not in call
    assert rows["turns"][0][4] != "failed"


def _fields_of_models() -> set[str]:
    """Every field of every pydantic model whose copies the product updates."""
    fields: set[str] = set()
    for module in (
        jetloop.schemas.records,
        jetloop.services.settings,
        jetloop.services.gateway.config,
        jetloop.services.gateway.openapi,
    ):
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseModel):
                fields |= set(cls.model_fields)
    return (
        fields
        | set(HistoryEntry.model_fields)
        | set(StepMessage.model_fields)
        | set(Carried.model_fields)
    )


def test_model_copy_updates_name_real_fields() -> None:
    """``model_copy(update={...})`` does not check its keys: a misspelt one would set an
    attribute no one reads and leave the field as it was. Every literal key in the product
    must be a field of a model it copies (a check by name across those models: it catches a
    misspelling, not a field of the wrong record)."""
    known = _fields_of_models()
    unknown = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "model_copy"
            ):
                continue
            for kw in node.keywords:
                if kw.arg == "update" and isinstance(kw.value, ast.Dict):
                    for k in kw.value.keys:
                        if isinstance(k, ast.Constant) and k.value not in known:
                            unknown.append(
                                f"{path.relative_to(JETLOOP.parent)}:{k.lineno} {k.value!r}"
                            )
    assert unknown == []
