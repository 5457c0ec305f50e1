"""What a turn's steps read: a ``run_model`` message carries its turn's and session's records
(as the step that published it wrote or read them), and a ``call_tools`` message that holds
every call of its step joins from what its calls know, without reading their records back.
The carried records are a hint the model step's claim checks (a CAS from their revision): a
turn written since is read again, and the step goes on from what it reads; they are sealed, and
a forged carry is read as none. A "first" delivery is one stored after the worker's link
opened (a restarted server may count a redelivery 1). Real nats-server, real worker
processes."""

from __future__ import annotations

import json
from pathlib import Path

from nats.aio.msg import Msg

from jetloop.consumers.carry import carry
from jetloop.consumers.followers import answer
from jetloop.demo.vendor import Vendor
from jetloop.schemas import StepKind, StepMessage, TurnStatus
from jetloop.services.client import Client
from jetloop.streams.bus import step_out
from jetloop.streams.seal import Sealer
from jetloop.streams.state import StateStore, turn_key
from tests.conftest import WorkerFactory, call, script
from tests.test_resume import pending_approval


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


async def test_a_forged_carry_is_not_used(
    client: Client, workers: WorkerFactory, vendor: Vendor, tmp_path: Path
) -> None:
    """Whoever may publish step messages (not the seal key) publishes a turn's first model
    step before its worker does, carrying the turn at its revision with another request
    text, sealed with another key. Used, the step's claim (a CAS from that revision) would
    write the forged turn back sealed, and the model would be given the forged text (the
    step restores the user's entry from the turn while the worker's own is not in yet). The
    worker refuses the carry and reads: the model is given the request as it was sent."""
    release = tmp_path / "release"
    w = workers.start("held", hold="turn_request.after_accept", release_file=release)
    h = await client.send("tester", "sr4", script([call("read", name="asked")]))
    await w.wait_for("fault.hold", point="turn_request.after_accept")
    state = await StateStore.open(client.nc, client.sealer)
    cur, session = await state.turn_view("sr4", h.turn_id)
    assert cur is not None and session is not None
    forged_turn = cur.value.model_copy(update={"text": script([call("read", name="forged")])})
    forged = carry(
        Sealer([b"another key"]), forged_turn, cur.revision, session.value, session.revision
    )
    assert forged is not None
    step = StepMessage(
        kind=StepKind.RUN_MODEL,
        agent="tester",
        session_id="sr4",
        turn_id=h.turn_id,
        model_step=0,
        carried=forged,
    )
    out = step_out(step)  # the step's own key: the worker's publish of it is a duplicate
    await client.js.publish(out.subject, out.body, headers=out.headers)
    await w.wait_for("model.call", timeout=10)  # the forged message's step, before release
    release.touch()
    assert (await client.wait(h, timeout=30)).status == TurnStatus.COMPLETED
    made = await vendor.payload_counts("read")
    assert {json.loads(p)["name"] for p in made} == {"asked"}, made
    turn = await client.turn("sr4", h.turn_id)
    assert turn is not None and "forged" not in turn.text
    assert len(w.find("step.carry_refused")) == 1


async def test_a_policy_set_while_the_model_step_ran_gates_its_read(
    client: Client, workers: WorkerFactory, tmp_path: Path
) -> None:
    """The approval policy is read when a call is routed: a session override set after the
    model step answered (while the worker holds before publishing the calls) still holds the
    read-only call for approval."""
    release = tmp_path / "release"
    w = workers.start("held", hold="run_model.after_commit", release_file=release)
    h = await client.send("tester", "sr5", script([call("read", name="r")]))
    await w.wait_for("fault.hold", point="run_model.after_commit")
    await client.set_approval("sr5", "read", True)
    release.touch()
    approval = await pending_approval(client, "sr5")
    await client.approve("sr5", approval)
    assert (await client.wait(h, timeout=30)).status == TurnStatus.COMPLETED


async def test_a_message_stored_before_the_link_is_not_a_first_delivery(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A nats-server restarted on its store may deliver again, counted as a first delivery, a
    message it delivered (even acked) before. A worker tells such a message by its stored time:
    before the worker's link to the server opened. Here the message of a turn's calls is
    stored while no worker runs (its model step's worker died after its commit), then a
    worker starts: its count says 1, but the read-only call is made as after a redelivery,
    claimed (a read made unclaimed by a delivery before, and again by this one, would count
    one attempt for two)."""
    victim = workers.start("victim", hold="run_model.after_commit")
    h = await client.send("tester", "sr6", script([call("read", name="r")]))
    await victim.wait_for("fault.hold", point="run_model.after_commit")
    victim.kill()
    cur = await client.turn("sr6", h.turn_id)
    assert cur is not None
    # What the victim would have published after its commit: the answer, then the calls.
    followers = answer(cur, in_one_message=True, folded=False)
    for out in [*followers.records, *followers.steps]:
        await client.js.publish(out.subject, out.body, headers=out.headers)
    survivor = workers.start("survivor")
    assert (await client.wait(h, timeout=30)).status == TurnStatus.COMPLETED
    [again] = survivor.find("call.read_delivered_again")
    assert again["delivery"] == 1 and again["kind"] == "call_tools"
    # Claimed as after a delivery that may have made it: counted for it too.
    rec = await client.call("sr6", h.turn_id, 0, 0)
    assert rec is not None and rec.attempts == 2
    assert sum((await vendor.request_counts("read")).values()) == 1
