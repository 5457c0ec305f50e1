"""Seals bind the record's key and its time (issue 13, finding 3): a sealed record copied to
another key, an older sealed state put back, or an approval or session edited by a raw put is
never acted on. The write a person guarded is the measure: ``pay big-…`` needs an approval
and is single-attempt with no vendor dedupe, so every run of it is one more effect."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest

from jetloop.demo.vendor import Vendor
from jetloop.schemas import Event, SessionRecord, StepKind, StepMessage
from jetloop.schemas.errors import ControlError
from jetloop.services.client import Client, TurnFailed
from jetloop.services.embedded import EmbeddedServer
from jetloop.streams.bus import Bus, step_out
from jetloop.streams.seal import SEAL_FIELD, SealBroken, Sealer, canonical, key_bytes, with_seal
from jetloop.streams.state import (
    StateStore,
    _copy_of,
    approval_key,
    call_state_key,
    session_key,
    turn_key,
)
from tests.conftest import SEAL_KEY, WorkerFactory, call, script, until
from tests.test_resume import pending_approval

TOLERANCE = 1.0  # seconds: a replay needs only to be older than this here
BEYOND = TOLERANCE + 1.0


@pytest.fixture
async def strict(nats_ready: EmbeddedServer) -> AsyncIterator[Client]:
    """A client whose seals allow the same short tolerance as the workers here."""
    c = await Client.connect(nats_ready.url, sealer=Sealer([key_bytes(SEAL_KEY)], TOLERANCE))
    yield c
    await c.close()


def start(workers: WorkerFactory) -> None:
    workers.start(env={"JETLOOP_SEAL_TOLERANCE_SECONDS": str(TOLERANCE)})


async def raw(client: Client, key: str) -> bytes:
    kv = await client.js.key_value("jl_state")
    entry = await kv.get(key)
    assert entry.value is not None
    return entry.value


async def put(client: Client, key: str, value: bytes) -> None:
    kv = await client.js.key_value("jl_state")
    await kv.put(key, value)


async def wake_approval(client: Client, session: str, turn_id: str, why: str) -> None:
    """What a stale redelivery or an attacker with publish rights sends: the call's step."""
    step = StepMessage(
        kind=StepKind.AWAIT_TOOL_APPROVAL,
        agent="tester",
        session_id=session,
        turn_id=turn_id,
        model_step=0,
        call_index=0,
        wake=why,
    )
    await Bus(client.js).publish([step_out(step)])


async def logged(client: Client, session: str, wait: float = 1.0) -> list[Event]:
    """The session's events so far (follows the log for ``wait`` seconds; never blocks)."""
    out: list[Event] = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(wait):
            async for e in client.events(session):
                out.append(e)
    return out


async def rejected_reasons(client: Client, session: str) -> list[str]:
    return [
        str(e.data["reason"])
        for e in await logged(client, session)
        if e.type == "agent.run.checkpoint_rejected"
    ]


async def test_a_record_copied_from_another_key_is_refused(
    strict: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A sealed call record from another session's finished call, put at this call's key,
    does not stand in for the call: the turn fails, and the foreign result is never its
    answer. (Without the key in the seal the turn completed with the foreign result.)"""
    start(workers)
    done = await strict.send("tester", "donor", script([call("write", name="donor")]))
    await strict.wait(done, timeout=30)
    h = await strict.send("tester", "splice", script([call("pay", name="big-1")]))
    approval = await pending_approval(strict, "splice")

    foreign = await raw(strict, call_state_key(f"donor.{done.turn_id}.0.0"))
    await put(strict, call_state_key(f"splice.{h.turn_id}.0.0"), foreign)
    await strict.approve("splice", approval, by="alice")
    with pytest.raises(TurnFailed, match="checkpoint not trusted"):
        await strict.wait(h, timeout=30)
    [reason] = await rejected_reasons(strict, "splice")
    assert "copied from another key" in reason
    assert await vendor.effect_count("pay") == 0


async def test_an_older_state_put_back_is_refused(
    strict: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """The turn's and the call's records as they were while the call awaited its approval,
    put back after the approved write was made and the turn completed, then the call's step
    sent again: the write is not made a second time. (Without the time in the seal the
    engine ran it again.)"""
    start(workers)
    h = await strict.send("tester", "replay", script([call("pay", name="big-1")]))
    approval = await pending_approval(strict, "replay")
    tk, ck = turn_key("replay", h.turn_id), call_state_key(f"replay.{h.turn_id}.0.0")
    old_turn, old_call = await raw(strict, tk), await raw(strict, ck)
    await strict.approve("replay", approval, by="alice")
    await strict.wait(h, timeout=30)
    assert await vendor.effect_count("pay") == 1

    await asyncio.sleep(BEYOND)  # the captured records' seals are now older than allowed
    await put(strict, tk, old_turn)
    await put(strict, ck, old_call)
    await wake_approval(strict, "replay", h.turn_id, "replayed")

    async def settled() -> bool:  # refused, or (the bug) made again
        made_again = await vendor.effect_count("pay") > 1
        return made_again or bool(await rejected_reasons(strict, "replay"))

    await until(settled, timeout=20)
    assert await vendor.effect_count("pay") == 1
    [reason] = await rejected_reasons(strict, "replay")
    assert "an older state put back" in reason


async def test_an_approval_edited_by_a_raw_put_is_not_a_decision(
    strict: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """An approval flipped to approved by a raw put: the control path refuses to act on it,
    the call's step fails the turn instead of running the write, and no
    ``approval.decided`` is ever recorded."""
    start(workers)
    h = await strict.send("tester", "forge", script([call("pay", name="big-1")]))
    approval = await pending_approval(strict, "forge")
    ak = approval_key("forge", approval)
    record = msgpack.unpackb(await raw(strict, ak))
    record.update(status="approved", decided_by="mallory", decided_at=1.0)
    await put(strict, ak, msgpack.packb(record))  # the old seal kept

    with pytest.raises(ControlError, match="not trusted"):
        await strict.reject("forge", approval, by="alice")
    await wake_approval(strict, "forge", h.turn_id, "forged")
    with pytest.raises(TurnFailed, match="checkpoint not trusted"):
        await strict.wait(h, timeout=30)
    types = [e.type for e in await logged(strict, "forge")]
    assert "approval.decided" not in types
    assert await vendor.effect_count("pay") == 0
    snap = await strict.snapshot("forge")
    assert snap is not None and snap.approvals == []
    assert any(u.startswith(f"{ak}: ") for u in snap.untrusted), snap.untrusted


async def undo_a_rejection(
    c: Client, workers: WorkerFactory, vendor: Vendor, session: str, pause: float
) -> None:
    """A person rejects the call; ``pause`` seconds later the pending approval (and the turn
    and call as they were then) are put back, and approved through the control path: refused
    as put back, and the write is never made."""
    assert c.sealer is not None
    workers.start(env={"JETLOOP_SEAL_TOLERANCE_SECONDS": str(c.sealer.tolerance)})
    h = await c.send("tester", session, script([call("pay", name="big-1")]))
    approval = await pending_approval(c, session)
    ak, tk = approval_key(session, approval), turn_key(session, h.turn_id)
    ck = call_state_key(f"{session}.{h.turn_id}.0.0")
    captured = {k: await raw(c, k) for k in (ak, tk, ck)}
    await c.reject(session, approval, by="alice", reason="no")
    await c.wait(h, timeout=30)

    await asyncio.sleep(pause)
    for k, v in captured.items():
        await put(c, k, v)
    with pytest.raises(ControlError, match="an older state put back"):
        await c.approve(session, approval, by="mallory")
    await wake_approval(c, session, h.turn_id, "undone")

    async def rejected() -> list[str]:
        return await rejected_reasons(c, session)

    await until(rejected, timeout=20)
    assert await vendor.effect_count("pay") == 0


async def test_a_rejection_cannot_be_undone_by_replaying_the_pending_approval(
    strict: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """The pending approval put back after the seal's time tolerance: refused."""
    await undo_a_rejection(strict, workers, vendor, "undo", BEYOND)


async def test_a_session_edited_by_a_raw_put_runs_nothing(
    strict: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A session record given an approval override by a raw put (``pay`` no longer needs a
    person): the next request in that session is dead-lettered with the reason, and the
    write is never made."""
    start(workers)
    first = await strict.send("tester", "sess", script([call("write", name="first")]))
    await strict.wait(first, timeout=30)

    async def first_done() -> bool:  # the session record moved past the first turn
        snap = await strict.snapshot("sess")
        return snap is not None and snap.turns_done == 1

    await until(first_done, timeout=10)
    sk = session_key("sess")
    record = msgpack.unpackb(await raw(strict, sk))
    record["approval_overrides"] = {"pay": False}
    await put(strict, sk, msgpack.packb(record))

    await strict.js.publish(
        "jl.turn.tester.sess",
        msgpack.packb({"text": script([call("pay", name="big-1")])}),
        headers={"Nats-Msg-Id": "sess.forged"},
    )

    async def dead() -> list[str]:
        return [r for s, r, _ in await strict.dead_letters() if s == "jl.turn.tester.sess"]

    [reason] = await until(dead, timeout=20)
    assert "SealBroken" in reason and sk in reason
    assert await vendor.effect_count("pay") == 0
    snap = await strict.snapshot("sess")  # still readable, and says why nothing runs
    assert snap is not None and snap.turns_done == 1
    assert [u.split(":")[0] for u in snap.untrusted] == [sk]


def test_seal_binds_key_and_time_and_rotates() -> None:
    """The seal itself: another key or another time does not verify; an old key still does."""
    now = 1_800_000_000.0
    old = Sealer([b"old"], 30, clock=lambda: now)
    new = Sealer([b"new", b"old"], 30, clock=lambda: now)
    data = {"v": 1, "x": "y"}
    sealed = {**data, "seal": old.seal("turn.s.t", data)}
    assert new.verify("turn.s.t", sealed, now + 1) is None  # rotation: the old key verifies
    assert "another key" in (new.verify("turn.s.u", sealed, now) or "")
    assert "older state" in (new.verify("turn.s.t", sealed, now + 31) or "")
    assert "older state" in (new.verify("turn.s.t", sealed, now - 31) or "")
    assert "not a v3 seal" in (new.verify("turn.s.t", {**data, "seal": "ab" * 32}, now) or "")
    assert "no seal" in (new.verify("turn.s.t", data, now) or "")


class CountingSealer(Sealer):
    def __init__(self) -> None:
        super().__init__([key_bytes(SEAL_KEY)])
        self.verified = 0

    def verify(
        self,
        key: str,
        data: dict[str, Any],
        stored_at: float,
        replaced: int | None = 0,
        stored: bytes | None = None,
    ) -> str | None:
        self.verified += 1
        return super().verify(key, data, stored_at, replaced, stored)


async def test_a_record_is_verified_once_and_an_edit_of_it_still_is_refused(
    client: Client,
) -> None:
    """The seal's verdict is remembered by the key, the stored bytes and the stored time: the
    same record read again costs no second HMAC, and each read is a copy of its own; the
    same key with other bytes (a raw put) is verified, and refused."""
    sealer = CountingSealer()
    store = await StateStore.open(client.nc, sealer)
    key = session_key("memo")
    await store.write(key, SessionRecord(session_id="memo", agent="tester"), None)
    first, again = await store.session("memo"), await store.session("memo")
    assert first is not None and again is not None
    assert sealer.verified == 1
    assert first.value == again.value and first.value is not again.value
    # Remembered decoded, but a reader's change to its copy is not what the next reads.
    first.value.active = "changed by a reader"
    third = await store.session("memo")
    assert third is not None and third.value.active is None and sealer.verified == 1
    edited = msgpack.unpackb(await raw(client, key))
    edited["turns_done"] = 99
    await put(client, key, msgpack.packb(edited))
    with pytest.raises(SealBroken):
        await store.session("memo")
    assert sealer.verified == 2


def test_a_remembered_record_is_handed_out_as_model_copy_would() -> None:
    """The copy each reader gets (``_copy_of``) is ``model_copy()``'s: equal, its own fields
    and fields-set, nested values shared; a change to it leaves the remembered one alone."""
    rec = SessionRecord(session_id="s", agent="a", turns_done=3)
    for record in (rec, rec.model_copy(update={"active": "t1"})):
        mine, theirs = _copy_of(record), record.model_copy()
        assert mine == theirs == record and mine is not record
        assert mine.__pydantic_fields_set__ == theirs.__pydantic_fields_set__
        assert mine.__pydantic_fields_set__ is not record.__pydantic_fields_set__
        assert mine.__pydantic_private__ == theirs.__pydantic_private__
        assert mine.__pydantic_extra__ == theirs.__pydantic_extra__
        mine.turns_done = 9
        assert record.turns_done == 3 and mine.model_dump() != record.model_dump()


def test_a_seal_added_to_packed_bytes_is_what_packing_the_sealed_record_makes() -> None:
    """``with_seal`` appends the seal to a record packed once; a reader unpacks the same map
    (fixmap and map16 headers, the growth from 15 keys to 16 included)."""
    for entries in (0, 1, 5, 14, 15, 16, 40):
        data: dict[str, Any] = {f"k{i}": [i, "x" * i, {"n": None}] for i in range(entries)}
        body = msgpack.packb(data, use_bin_type=True)
        sealed = with_seal(body, len(data), "v2.1.abc")
        assert sealed == msgpack.packb({**data, SEAL_FIELD: "v2.1.abc"}, use_bin_type=True)
        assert canonical(msgpack.unpackb(sealed)) == body


@pytest.fixture
async def lenient(nats_ready: EmbeddedServer) -> AsyncIterator[Client]:
    """A client sealing with the default tolerance (30 s), as the workers started by
    ``workers.start()`` without settings do: a replay here is well inside it."""
    c = await Client.connect(nats_ready.url, sealer=Sealer([key_bytes(SEAL_KEY)]))
    yield c
    await c.close()


async def test_a_session_put_back_inside_the_tolerance_runs_nothing(
    lenient: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """An operator waives approval of ``pay`` in a session, then requires it again; the
    session record as it was while waived is put back a moment later (far inside the seal's
    time tolerance) by a raw put with worker rights. The record names the revision it was
    written over, and the server keeps the revision the put replaced: they differ, so the
    record is refused, the next request is dead-lettered, and no payment is made. (Before
    the seal named that revision, the call ran without approval.)"""
    workers.start()
    sk = session_key("waive")
    await lenient.set_approval("waive", "pay", False, agent="tester")
    waived = await raw(lenient, sk)
    await lenient.set_approval("waive", "pay", True)
    await put(lenient, sk, waived)

    await lenient.js.publish(
        "jl.turn.tester.waive",
        msgpack.packb({"text": script([call("pay", name="big-1")])}),
        headers={"Nats-Msg-Id": "waive.replayed"},
    )

    async def dead() -> list[str]:
        return [r for s, r, _ in await lenient.dead_letters() if s == "jl.turn.tester.waive"]

    [reason] = await until(dead, timeout=20)
    assert "put back" in reason and sk in reason, reason
    assert await vendor.effect_count("pay") == 0


async def test_a_rejection_cannot_be_undone_inside_the_tolerance(
    lenient: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """The pending approval put back at once, far inside the seal's time tolerance (30 s):
    refused all the same, by the revision the seal names."""
    await undo_a_rejection(lenient, workers, vendor, "undo2", 0.0)
