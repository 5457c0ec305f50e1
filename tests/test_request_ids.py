"""The request id rule of docs/protocol.md, spoken by a raw NATS client (no jetloop code on
the sending side): ``Nats-Msg-Id: <session>.<request id>``. ``JL_TURNS`` drops a repeated
message id across all its subjects, so an unscoped id is refused loudly on first use instead
of making the same request id in a second session a silent duplicate that never runs."""

from __future__ import annotations

import json

import nats
import pytest
from nats.js.errors import APIError

from jetloop.schemas import turn_id_for
from jetloop.services.client import Client
from jetloop.streams.connection import MSG_ID_IN_PROCESS, retrying
from tests.conftest import WorkerFactory, script, until


async def test_same_request_id_in_two_sessions_runs_twice_and_unscoped_ids_are_refused(
    client: Client, workers: WorkerFactory
) -> None:
    """Two sessions use request id ``r-1`` (JSON bodies, as ``nats pub`` sends): both turns
    run, each ``turn.accepted`` names its turn and request id; a resend is a duplicate; a
    bare ``Nats-Msg-Id`` and one that disagrees with ``Jl-Request-Id`` are dead-lettered with
    the fix in the reason, and the session's next (scoped) request runs at once."""
    workers.start()
    nc = await nats.connect(client.nc.connected_url.geturl())  # type: ignore[union-attr]
    try:
        js = nc.jetstream()

        async def pub(session: str, msg_id: str, answer: str, **extra: str) -> bool:
            body = json.dumps({"text": script(answer=answer)}).encode()
            hdrs = {"Nats-Msg-Id": msg_id, **extra}
            ack = await js.publish(f"jl.turn.tester.{session}", body, headers=hdrs)
            return bool(ack.duplicate)

        assert not await pub("ra", "ra.r-1", "in ra")
        assert not await pub("rb", "rb.r-1", "in rb")
        assert await pub("ra", "ra.r-1", "in ra")  # the resend: stored once
        assert not await pub("rc", "r-1", "never runs")  # stored, then refused
        assert not await pub("rc", "rc.x", "never runs", **{"Jl-Request-Id": "y"})
        assert not await pub("rc", "rc.r-2", "in rc")
    finally:
        await nc.close()

    for session, answer in (("ra", "in ra"), ("rb", "in rb"), ("rc", "in rc")):
        rid = "r-2" if session == "rc" else "r-1"
        tid = turn_id_for(session, rid)

        async def ended(session: str = session, tid: str = tid) -> object:
            t = await client.turn(session, tid)
            return t if t is not None and t.status.terminal else None

        turn = await until(ended, timeout=30)
        assert turn.status.value == "completed" and turn.request_id == rid
        assert (await client.answer_text(turn) or "").startswith(answer)
        async for ev in client.events(session, types=("turn.accepted",)):
            assert (ev.turn_id, ev.data["request_id"]) == (tid, rid)
            break

        # The session counts the turn just after its end is told: wait for it.
        async def counted(session: str = session) -> bool:
            snap = await client.snapshot(session)
            return snap is not None and snap.turns_done == 1

        assert await until(counted, timeout=10)

    letters = [(r, b) for s, r, b in await client.dead_letters() if s == "jl.turn.tester.rc"]
    [(bare, _), (mismatch, _)] = letters
    assert "'r-1' is not 'rc.<request id>'" in bare, bare
    assert "'Nats-Msg-Id: rc.y'" in mismatch, mismatch


async def test_a_send_whose_id_is_in_process_is_asked_again() -> None:
    """JetStream answers a publish whose ``Nats-Msg-Id`` another publish is storing at that
    moment with error 10158 ("duplicate message id is in process"): a client that sends a
    request again beside its own retry after an outage met it. ``retrying`` asks again (the
    server then answers "duplicate"), and still raises any other API error at once."""
    calls: list[int] = []

    async def in_process_once() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise APIError(code=409, err_code=MSG_ID_IN_PROCESS, description="in process")
        return "duplicate"

    assert await retrying(in_process_once, 5.0, "send") == "duplicate"
    assert len(calls) == 2

    async def refused() -> str:
        raise APIError(code=400, err_code=10071, description="wrong last sequence")

    with pytest.raises(APIError):
        await retrying(refused, 5.0, "send")
