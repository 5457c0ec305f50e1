"""What a turn's steps read: a ``run_model`` message carries its turn's and session's records
(as the step that published it wrote or read them), and a ``call_tools`` message that holds
every call of its step joins from what its calls know, without reading their records back.
The carried records are a hint the model step's claim checks (a CAS from their revision): a
turn written since is read again, and the step goes on from what it reads. Real nats-server,
real worker processes."""

from __future__ import annotations

import json
from pathlib import Path

from nats.aio.msg import Msg

from jetloop.schemas import TurnStatus
from jetloop.services.client import Client
from jetloop.streams.state import StateStore, turn_key
from tests.conftest import WorkerFactory, call, script


async def _multi_reads(client: Client) -> list[list[str]]:
    """The keys of every batched read of ``jl_state`` from now on (a core subscription sees
    each request: the client's own reads of one key are not batched)."""
    seen: list[list[str]] = []

    async def on(msg: Msg) -> None:
        req = json.loads(msg.data or b"{}")
        if "multi_last" in req:
            seen.append([k.removeprefix("$KV.jl_state.") for k in req["multi_last"]])

    await client.nc.subscribe("$JS.API.DIRECT.GET.KV_jl_state", cb=on)
    await client.nc.flush()
    return seen


async def test_a_turn_reads_its_turn_and_session_once(
    client: Client, workers: WorkerFactory
) -> None:
    """A turn of two model steps and three calls: the turn and the session are read together
    once (by the request's step); both model steps take them from their message, and the
    join of the three calls reads none of their records."""
    w = workers.start()
    await w.wait_for("worker.started", timeout=30)
    reads = await _multi_reads(client)
    h = await client.send(
        "tester",
        "sr1",
        script([call("read", name="a"), call("read", name="b"), call("write", name="c")]),
    )
    res = await client.wait(h, timeout=30)
    assert res.status == TurnStatus.COMPLETED
    turn, session = f"turn.sr1.{h.turn_id}", "session.sr1"
    assert [r for r in reads if sorted(r) == sorted([turn, session])] == [[turn, session]], reads
    assert not [r for r in reads if any(k.endswith(".0.*") for k in r)], reads


async def test_a_carried_turn_written_since_is_read_again(
    client: Client, workers: WorkerFactory, tmp_path: Path
) -> None:
    """The turn is written after its first model step's message was built (here: while the
    request's step holds before publishing it): the step's claim from the carried revision
    fails, nothing is written, and the same delivery reads the turn and goes on; the message
    is acked on its first delivery and the model step counts one attempt."""
    release = tmp_path / "release"
    w = workers.start("held", hold="turn_request.after_accept", release_file=release)
    h = await client.send("tester", "sr2", script(answer="fine"))
    await w.wait_for("fault.hold", point="turn_request.after_accept")
    state = await StateStore.open(client.nc, client.sealer)
    cur = await state.turn("sr2", h.turn_id)
    assert cur is not None
    await state.write(turn_key("sr2", h.turn_id), cur.value, cur.revision)  # same value, newer
    release.touch()
    res = await client.wait(h, timeout=30)
    assert res.status == TurnStatus.COMPLETED
    assert len(w.find("run_model.carried_stale")) == 1
    # (acked after the turn's end is published, which the wait hears)
    await w.wait_for("step.acked", kind="run_model", timeout=10)
    acked = w.find("step.acked", kind="run_model")
    assert [ln["delivery"] for ln in acked] == [1]
    turn = await client.turn("sr2", h.turn_id)
    assert turn is not None and turn.attempts == 1
