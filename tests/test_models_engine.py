"""The demo agent on each provider's wire format, through the whole engine.

A local fake server speaks the provider's API; a worker process runs the demo agent with
``JETLOOP_MODEL`` pointing at it. The same scripted conversation yields equivalent
histories on every provider, and a worker killed while the model call is in flight costs
only that call: the history holds one answer.
"""

from __future__ import annotations

from typing import Any

import pytest

from jetloop.demo.vendor import Vendor
from jetloop.services.client import Client
from tests.conftest import WorkerFactory
from tests.fakes.anthropic import FakeAnthropic
from tests.fakes.base import FakeCall, Reply, Stall
from tests.fakes.openai_chat import FakeOpenAIChat
from tests.fakes.openai_responses import FakeOpenAIResponses

PROVIDERS: dict[str, tuple[Any, str]] = {
    "openai-chat": (FakeOpenAIChat, "openai:gpt-test"),
    "openai-responses": (FakeOpenAIResponses, "openai-responses:gpt-test"),
    "anthropic": (FakeAnthropic, "anthropic:claude-test"),
}


def model_env(fake: Any, spec: str) -> dict[str, str]:
    return {
        "JETLOOP_MODEL": spec,
        "JETLOOP_MODEL_API_KEY": fake.api_key,
        "JETLOOP_MODEL_BASE_URL": fake.base_url,
    }


def shape(history: list[Any]) -> list[tuple[Any, ...]]:
    """What must match across providers: roles, texts, tool names, arguments, statuses."""
    out: list[tuple[Any, ...]] = []
    for e in history:
        calls = tuple((c.tool, tuple(sorted(c.args.items()))) for c in e.calls)
        out.append((e.role, e.text, calls, e.tool, e.status, repr(e.result)))
    return out


@pytest.mark.parametrize("provider", list(PROVIDERS))
async def test_demo_conversation_on_each_provider(
    client: Client, workers: WorkerFactory, vendor: Vendor, provider: str
) -> None:
    """Tool calls planned by the provider run durably; the answer closes the turn."""
    cls, spec = PROVIDERS[provider]
    async with cls() as fake:
        fake.script(
            Reply(text="Opening it.", calls=(FakeCall("create_ticket", {"title": "printer"}),)),
            Reply(text="Ticket T-1 is open."),
        )
        workers.start(app="jetloop.demo.agent:app", env=model_env(fake, spec))
        h = await client.send("demo", f"m-{provider}", "please open a printer ticket")
        res = await client.wait(h, timeout=60)
        assert res.text == "Ticket T-1 is open."
        assert len(fake.received) == 2
    snap = await client.snapshot(f"m-{provider}")
    assert snap is not None
    assert [c.state for c in snap.calls] == ["succeeded"]
    assert await vendor.effect_count("create_ticket") == 1
    shapes = shape(snap.history)
    assert [s[0] for s in shapes] == ["user", "assistant", "tool", "assistant"]
    usage = []
    async for ev in client.events(f"m-{provider}"):
        if ev.type in ("model.answered", "turn.completed"):
            usage.append(ev.data["usage"])
        if ev.type == "turn.completed":
            break
    # the fakes report 11 tokens in and 7 out for every answer
    assert [u["output_tokens"] for u in usage] == [7, 7]
    assert all(u["input_tokens"] >= 11 for u in usage)


async def test_same_history_on_every_provider(client: Client, workers: WorkerFactory) -> None:
    """The same scripted conversation yields the same jetloop history on each provider."""
    histories = []
    for provider, (cls, spec) in PROVIDERS.items():
        async with cls() as fake:
            fake.script(
                Reply(text="Looking.", calls=(FakeCall("list_tickets", {}),)),
                Reply(text="No tickets yet."),
            )
            w = workers.start(app="jetloop.demo.agent:app", env=model_env(fake, spec))
            h = await client.send("demo", f"same-{provider}", "what tickets are there?")
            await client.wait(h, timeout=60)
            w.kill()
        snap = await client.snapshot(f"same-{provider}")
        assert snap is not None
        histories.append(shape(snap.history))
    assert histories[0] == histories[1] == histories[2]


async def test_worker_killed_during_the_model_call(client: Client, workers: WorkerFactory) -> None:
    """Killed while the provider's answer is in flight: that call is asked again and the
    history holds one answer."""
    async with FakeOpenAIChat() as fake:
        fake.script(Stall(), Reply(text="The one answer."))
        env = model_env(fake, "openai:gpt-test")
        victim = workers.start("victim", app="jetloop.demo.agent:app", env=env)
        h = await client.send("demo", "kill-mid", "hello")

        async def in_flight() -> bool:
            return len(fake.received) >= 1

        from tests.conftest import until

        await until(in_flight)
        victim.kill()
        workers.start("survivor", app="jetloop.demo.agent:app", env=env)
        res = await client.wait(h, timeout=60)
        assert res.text == "The one answer."
        assert len(fake.received) == 2
    snap = await client.snapshot("kill-mid")
    assert snap is not None
    assert [e.role for e in snap.history] == ["user", "assistant"]
