"""The usage ledger: every model call that got an answer is counted once, crashes included.

A worker runs the demo agent against a fake OpenAI-compatible provider that bills each answer
it sends; a worker killed after the provider answered and before the step committed makes
the step run again, and both calls are in the ledger — `jetloop usage` equals what the
provider billed, call for call, and prices them by the price table.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from jetloop.agents.prices import DEFAULT_PRICES, Price, Prices
from jetloop.schemas.errors import TurnFailed
from jetloop.schemas.records import Spent
from jetloop.services.client import Client, TurnHandle
from jetloop.services.embedded import EmbeddedServer
from jetloop.services.gateway.app import make_app
from jetloop.services.readmodel.projector import Projector
from jetloop.sessions.usage import UsageLine, totals, totals_json
from jetloop.streams.registry import Registry
from jetloop.streams.topology import EVENTS_STREAM, event_subject
from jetloop.tooling.trials.harness import WorkerProcess
from tests.conftest import WorkerFactory, until
from tests.fakes.base import Failure, FakeCall, Reply
from tests.fakes.openai_chat import FakeOpenAIChat
from tests.test_gateway import READ, make_config, ok, problem

MODEL = "gpt-4o-mini"


def env_of(fake: FakeOpenAIChat, **extra: str) -> dict[str, str]:
    return {
        "JETLOOP_MODEL": f"openai:{MODEL}",
        "JETLOOP_MODEL_API_KEY": fake.api_key,
        "JETLOOP_MODEL_BASE_URL": fake.base_url,
        **extra,
    }


def test_prices_by_name_prefix_and_override() -> None:
    prices = Prices({"my-model": Price(input=1.0, output=2.0)})
    usage = {"input_tokens": 1_000_000, "output_tokens": 500_000, "cached_input_tokens": 200_000}
    mini = DEFAULT_PRICES["gpt-4o-mini"]
    want = 0.8 * mini.input + 0.2 * (mini.cached_input or 0) + 0.5 * mini.output
    assert prices.cost("gpt-4o-mini-2024-07-18", usage) == pytest.approx(want)
    assert prices.cost("openai:gpt-4o-mini", usage) == pytest.approx(want)
    assert prices.cost("my-model", usage) == pytest.approx(1.0 + 1.0)  # cached at input price
    assert prices.cost("nobody-knows", usage) is None
    assert prices.cost(None, usage) is None


def test_a_total_with_an_unpriced_call_has_no_cost() -> None:
    """A total with one unpriced call in it says null, never the priced part as the whole
    ($0 when all are unpriced), with the priced calls' sum and the count beside; a record's
    spent counts the unpriced calls too."""

    def line(n: int, cost: float | None, model: str) -> UsageLine:
        return UsageLine(
            key=f"s.t.m{n}.a1.usage",
            session_id="s",
            turn_id="t",
            at=0.0,
            agent="a",
            model=model,
            purpose="turn",
            model_step=n,
            attempt=1,
            input_tokens=10,
            output_tokens=5,
            cached_input_tokens=0,
            cost_usd=cost,
        )

    mixed = [line(0, 0.25, "gpt-4o"), line(1, None, "local"), line(2, 0.5, "gpt-4o")]
    report = totals_json(mixed, "model")
    assert report["total"]["cost_usd"] is None
    assert report["total"]["priced_cost_usd"] == 0.75 and report["total"]["unpriced_calls"] == 1
    by_model = {g["group"]: g for g in report["groups"]}
    assert by_model["gpt-4o"]["cost_usd"] == 0.75 and by_model["local"]["cost_usd"] is None
    assert totals_json([line(0, None, "local")])["total"]["cost_usd"] is None
    assert totals_json(mixed[:1])["total"]["cost_usd"] == 0.25

    spent = Spent().plus(10, 5, 0.25).plus(10, 5, None)
    assert (spent.cost_usd, spent.unpriced_calls) == (0.25, 1)
    assert spent.add(spent).unpriced_calls == 2
    assert Spent.model_validate({"calls": 1, "cost_usd": 0.1}).unpriced_calls == 0  # before 0.2


async def test_usage_equals_what_the_provider_billed_across_a_worker_kill(
    client: Client, workers: WorkerFactory, tmp_path: Path
) -> None:
    """Killed between the provider's answer and the commit: the step's model call is made
    again, and the ledger holds both attempts — the sum the provider billed, call for call.
    (The usage goes out beside the commit, so the kill waits until it has left the process:
    a kill in the instant before, as in any design, would take it along.)"""
    async with FakeOpenAIChat() as fake:
        opening = (FakeCall("create_ticket", {"title": "printer"}),)
        fake.script(
            Reply(text="Opening it.", calls=opening, usage=(120, 30)),  # lost with its worker
            Reply(text="Opening it.", calls=opening, usage=(121, 31)),
            Reply(text="Ticket T-1 is open.", usage=(200, 40)),
        )
        victim = workers.start(
            env=env_of(fake), app="jetloop.demo.agent:app", hold="run_model.before_commit"
        )
        h = await client.send("demo", "u1", "please open a printer ticket")
        await victim.wait_for("fault.hold", point="run_model.before_commit", timeout=30)

        async def first_paid() -> bool:
            return any(x.attempt == 1 for x in await client.usage("u1"))

        await until(first_paid, timeout=10)
        victim.kill()
        workers.start(env=env_of(fake), app="jetloop.demo.agent:app")
        res = await client.wait(h, timeout=60)
        assert res.text == "Ticket T-1 is open."
        billed = list(fake.billed)
    assert billed == [(120, 30), (121, 31), (200, 40)]

    lines = await client.usage("u1")
    got = sorted((x.model_step, x.attempt, x.input_tokens, x.output_tokens) for x in lines)
    assert got == [(0, 1, 120, 30), (0, 2, 121, 31), (1, 1, 200, 40)]
    assert all(x.turn_id == h.turn_id and x.agent == "demo" and x.model == MODEL for x in lines)
    price = DEFAULT_PRICES[MODEL]
    want = sum(i * price.input + o * price.output for i, o in billed) / 1_000_000
    total = totals(lines)["all"]
    assert (total.calls, total.input_tokens, total.output_tokens) == (3, 441, 101)
    assert total.cost_usd == pytest.approx(want) and total.unpriced_calls == 0

    # The CLI reads the same ledger (from the stream, no read model needed).
    out = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "jetloop.services.cli",
            "usage",
            "--session",
            "u1",
            "--by",
            "turn",
            "--json",
            "--nats",
            workers.url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["total"]["calls"] == 3 and report["total"]["tokens"] == 542
    assert report["total"]["cost_usd"] == pytest.approx(want)
    assert [g["group"] for g in report["groups"]] == [f"u1/{h.turn_id}"]

    # The gateway answers the same totals from the read model.
    config = make_config(tmp_path)
    assert config.readmodel_db is not None
    await Projector([workers.url], config.readmodel_db, burst=True).run()
    async with TestClient(TestServer(make_app(config, workers.url))) as api:
        got_http = await ok(await api.get("/v1/usage?session=u1&by=turn", headers=READ))
        assert got_http == report
        by_model = await ok(await api.get("/v1/usage?by=model", headers=READ))
        assert [g["group"] for g in by_model["groups"]] == [MODEL]
        await problem(await api.get("/v1/usage?turn=x", headers=READ), 422)
        await problem(await api.get("/v1/usage?by=colour", headers=READ), 422)
        await problem(await api.get("/v1/usage"), 401)


BUDGETS = "tests.apps_budget:app"


async def two_workers(workers: WorkerFactory, env: dict[str, str]) -> list[WorkerProcess]:
    """Two workers of the demo app on the fake provider, both serving."""
    pair = [workers.start(env=env, app="jetloop.demo.agent:app") for _ in range(2)]
    for w in pair:
        await w.wait_for("worker.started", timeout=30)
    return pair


async def no_attempt_used(client: Client, handles: list[TurnHandle]) -> None:
    """Each turn's model step was made on its first attempt: waiting used none."""
    for h in handles:
        snap = await client.snapshot(h.session_id)
        assert snap is not None and snap.turn is not None and snap.turn.attempts == 1


@pytest.fixture
async def declared(client: Client) -> Client:
    """The budget app's agents declared as a deploy does, so a send waits for its worker."""
    registry = await Registry.open(client.js)
    await registry.declare(["capped", "thrifty"], "tests")
    return client


async def test_a_turn_stops_at_its_budget_and_the_next_turn_is_told(
    declared: Client, workers: WorkerFactory
) -> None:
    """`capped` may use 250 tokens a turn, each answer uses 120: two calls are made, the
    third would pass the cap, and the turn fails with the budget's reason; the session's
    next turn runs, and its model is told why the turn before stopped."""
    client = declared
    workers.start(app=BUDGETS)
    h = await client.send("capped", "b1", "loop for ever")
    with pytest.raises(TurnFailed) as failed:
        await client.wait(h, timeout=60)
    error = failed.value.turn.error or ""
    assert error.startswith("budget: the turn's cap of 250 tokens would be passed: 240 used")
    assert failed.value.turn.spent.calls == 2 and failed.value.turn.spent.tokens == 240
    lines = await client.usage("b1")
    assert [(x.model_step, x.attempt) for x in lines] == [(0, 1), (1, 1)]
    nxt = await client.wait(await client.send("capped", "b1", "what happened?"), timeout=60)
    assert "stopped by its budget" in (nxt.text or "") and "250 tokens" in (nxt.text or "")

    async def both_ended() -> Any:  # the session moves on just after the turn's record ends
        snap = await client.snapshot("b1")
        return snap if snap is not None and snap.turns_done == 2 else None

    snap = await until(both_ended)
    assert snap.spent.calls == 3 and snap.spent.tokens == 360


async def test_a_usage_record_a_server_lost_beside_its_commit_is_told_again(
    server: EmbeddedServer, client: Client, workers: WorkerFactory
) -> None:
    """A model step's usage and its commit are in flight together. A server that stops
    between them may keep the commit only (simulated: the record deleted from the log, the
    server restarted, so its dedupe no longer knows the key): the step's next delivery finds
    the answer committed and tells the usage again from the record, so the ledger still
    holds every call the provider billed, each once."""
    async with FakeOpenAIChat() as fake:
        fake.script(
            Reply(text="Opening it.", calls=(FakeCall("create_ticket", {"title": "a"}),)),
            Reply(text="Ticket T-1 is open.", usage=(200, 40)),
        )
        victim = workers.start(
            env=env_of(fake), app="jetloop.demo.agent:app", hold="run_model.after_commit"
        )
        h = await client.send("demo", "u9", "please open a ticket")
        await victim.wait_for("fault.hold", point="run_model.after_commit", timeout=30)
        victim.kill()
        js = client.nc.jetstream()
        usage = await js.get_last_msg(EVENTS_STREAM, event_subject("u9", "model.usage"))
        await js.delete_msg(EVENTS_STREAM, usage.seq)
        server.restart()
        await server.wait_jetstream()
        workers.start(env=env_of(fake), app="jetloop.demo.agent:app")
        res = await client.wait(h, timeout=60)
        assert res.text == "Ticket T-1 is open."
        billed = list(fake.billed)
    assert len(billed) == 2  # the answered step was not asked again
    lines = await client.usage("u9")
    got = sorted((x.model_step, x.attempt, x.input_tokens, x.output_tokens) for x in lines)
    assert got == [(0, 1, *billed[0]), (1, 1, 200, 40)]
    assert all(x.model == MODEL for x in lines)


async def test_a_crash_does_not_reset_the_count(
    declared: Client, workers: WorkerFactory, tmp_path: Path
) -> None:
    """Killed after its second call was answered and before the commit: the resumed step
    counts the lost call from the ledger, so the turn stops there — two calls paid, not a
    third made because the crash lost the count."""
    client = declared
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"holds": ["run_model.before_commit@b2#2"]}))
    victim = workers.start(app=BUDGETS, env={"JETLOOP_FAULT_PLAN": str(plan)})
    h = await client.send("capped", "b2", "loop until the cap")
    await victim.wait_for("fault.hold", point="run_model.before_commit", timeout=30)
    victim.kill()
    workers.start(app=BUDGETS)
    with pytest.raises(TurnFailed) as failed:
        await client.wait(h, timeout=60)
    assert (failed.value.turn.error or "").startswith(
        "budget: the turn's cap of 250 tokens would be passed: 240 used in 2 model call(s)"
    )
    lines = await client.usage("b2")
    assert sorted((x.model_step, x.attempt) for x in lines) == [(0, 1), (1, 1)]
    assert failed.value.turn.spent.calls == 2 and failed.value.turn.spent.tokens == 240


async def test_a_session_stops_at_its_cost_budget(declared: Client, workers: WorkerFactory) -> None:
    """`thrifty` may spend $0.000055 a session and each answer costs $0.000027: two turns
    run, the third fails with the session's cap."""
    client = declared
    workers.start(app=BUDGETS)
    for text in ("one", "two"):
        await client.wait(await client.send("thrifty", "b3", text), timeout=60)
    with pytest.raises(TurnFailed) as failed:
        await client.wait(await client.send("thrifty", "b3", "three"), timeout=60)
    assert (failed.value.turn.error or "").startswith("budget: the session's cap of $0.0001")
    total = totals(await client.usage("b3"))["all"]
    assert total.calls == 2 and total.cost_usd == pytest.approx(2 * 0.000027)


async def test_a_429_pauses_every_worker_and_uses_no_attempt(
    client: Client, workers: WorkerFactory
) -> None:
    """The provider answers one call "429, retry after 2 s": that worker pauses the endpoint
    for every worker (`jl_limits`), both hear it, nobody calls the provider until the pause
    ends although six more turns arrive meanwhile, and no model step used an attempt on it."""
    async with FakeOpenAIChat() as fake:
        fake.script(
            Failure(429, "Rate limit reached", "rate_limit_error", {"retry-after": "2"}),
            *[Reply(text="ok") for _ in range(7)],
        )
        pair = await two_workers(workers, env_of(fake))
        first = await client.send("demo", "r0", "hello")

        async def heard() -> bool:  # the one throttled, and the other from the bucket
            return all(w.find("pause.heard") or w.find("model.throttled") for w in pair)

        await until(heard, timeout=10)
        rest = [await client.send("demo", f"r{i}", "hello") for i in range(1, 7)]
        for h in (first, *rest):
            assert (await client.wait(h, timeout=60)).text == "ok"
        received = list(fake.received)
    assert len(received) == 8, "one 429, then one call per turn"
    throttled_at = received[0].at
    assert min(r.at for r in received[1:]) >= throttled_at + 1.9, "nobody called in the pause"
    snap = await client.snapshot("r0")
    assert snap is not None and snap.turn is not None and snap.turn.attempts == 1


async def test_a_token_limit_per_window_holds_across_two_workers(
    client: Client, workers: WorkerFactory
) -> None:
    """Two workers share 500 tokens per 3-second window on one endpoint; each call uses 120
    (its reservation): twelve turns sent at once are spread over windows of at most four
    calls, none failed and none used an attempt on it. Measured in the shared windows of
    `jl_limits` and at the provider."""
    limits = {
        f"openai:{MODEL}": {"tokens_per_minute": 500, "reserve_tokens": 120, "window_seconds": 3}
    }
    async with FakeOpenAIChat() as fake:
        fake.script(*[Reply(text="ok", usage=(100, 20)) for _ in range(12)])
        env = env_of(fake, JETLOOP_PROVIDER_LIMITS=json.dumps(limits))
        await two_workers(workers, env)
        handles = [await client.send("demo", f"t{i}", "hello") for i in range(12)]
        for h in handles:
            assert (await client.wait(h, timeout=60)).text == "ok"
        arrivals = [r.at for r in fake.received]
    assert len(arrivals) == 12 and fake.billed == [(100, 20)] * 12
    kv = await client.js.key_value("jl_limits")
    windows = [
        json.loads((await kv.get(k)).value or b"{}")
        for k in await kv.keys()
        if k.startswith("window.")
    ]
    print("windows:", windows)
    assert sum(w["requests"] for w in windows) == 12
    assert all(w["tokens"] <= 500 and w["requests"] <= 4 for w in windows), windows
    assert len(windows) >= 3
    # At the provider: per 3-second window of arrival, at most four calls (one more where a
    # call admitted at a window's last instant arrived in the next).
    per_window: dict[int, int] = {}
    for at in arrivals:
        per_window[int(at // 3)] = per_window.get(int(at // 3), 0) + 1
    print("at the provider:", per_window)
    assert max(per_window.values()) <= 5, per_window
    await no_attempt_used(client, handles)


async def test_calls_in_flight_are_capped_across_two_workers(
    client: Client, workers: WorkerFactory
) -> None:
    """Two workers may have two calls in flight to the endpoint together: six turns sent at
    once, each call taking half a second at the provider, never have more than two there
    at a time, and none used an attempt waiting for a slot."""
    limits = {f"openai:{MODEL}": {"concurrent": 2}}
    async with FakeOpenAIChat() as fake:
        fake.script(*[Reply(text="ok", delay=0.5) for _ in range(6)])
        env = env_of(fake, JETLOOP_PROVIDER_LIMITS=json.dumps(limits))
        await two_workers(workers, env)
        handles = [await client.send("demo", f"c{i}", "hello") for i in range(6)]
        for h in handles:
            assert (await client.wait(h, timeout=60)).text == "ok"
        assert fake.most_in_flight == 2, fake.most_in_flight
    await no_attempt_used(client, handles)


async def test_a_slot_held_by_a_dead_worker_is_taken_over(
    client: Client, workers: WorkerFactory
) -> None:
    """One call in flight at most, and the worker holding the slot is SIGKILLed inside the
    model step: the step's new attempt finds the slot's attempt gone from the turn record
    and takes the slot over; the turn completes."""
    limits = {f"openai:{MODEL}": {"concurrent": 1}}
    async with FakeOpenAIChat() as fake:
        fake.script(Reply(text="ok"))
        env = env_of(fake, JETLOOP_PROVIDER_LIMITS=json.dumps(limits))
        victim = workers.start(env=env, app="jetloop.demo.agent:app", hold="run_model.in_call")
        h = await client.send("demo", "dead-slot", "hello")
        await victim.wait_for("fault.hold", point="run_model.in_call", timeout=30)
        kv = await client.js.key_value("jl_limits")
        held = [k for k in await kv.keys() if k.startswith("slot.")]
        assert len(held) == 1, held
        victim.kill()
        workers.start(env=env, app="jetloop.demo.agent:app")
        assert (await client.wait(h, timeout=60)).text == "ok"
