"""Traces of turns, exported over OTLP/HTTP to a receiver that decodes the real protobuf.

One demo turn on a fake OpenAI-compatible provider, with a tool call whose worker is
SIGKILLed mid-tool: one trace, parented by the caller's ``traceparent``; the turn span; the
model spans with the GenAI attributes and token counts; the tool span of the attempt made
again, with its effect and idempotency key and a link to the first attempt's span.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from jetloop.consumers.tracing import attempt_span_id
from jetloop.services.client import Client
from tests.conftest import WorkerFactory, until
from tests.fakes.base import FakeCall, Reply
from tests.fakes.openai_chat import FakeOpenAIChat
from tests.fakes.otlp import OtlpReceiver

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")

MODEL = "gpt-4o-mini"
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


def env_of(fake: FakeOpenAIChat, otlp: OtlpReceiver) -> dict[str, str]:
    return {
        "JETLOOP_MODEL": f"openai:{MODEL}",
        "JETLOOP_MODEL_API_KEY": fake.api_key,
        "JETLOOP_MODEL_BASE_URL": fake.base_url,
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }


async def test_one_trace_across_a_worker_kill(client: Client, workers: WorkerFactory) -> None:
    async with FakeOpenAIChat() as fake, OtlpReceiver() as otlp:
        fake.script(
            Reply(calls=(FakeCall("create_ticket", {"title": "printer"}),), usage=(120, 30)),
            Reply(text="Ticket T-1 is open.", usage=(200, 40)),
        )
        env = env_of(fake, otlp)
        victim = workers.start(env=env, app="jetloop.demo.agent:app", hold="call_tool.in_tool")
        h = await client.send("demo", "tr", "open a printer ticket", traceparent=TRACEPARENT)
        await victim.wait_for("fault.hold", point="call_tool.in_tool", timeout=30)

        async def first_model_span() -> bool:
            return bool(otlp.named("chat "))

        await until(first_model_span, timeout=15)  # exported by the worker about to die
        victim.kill()
        workers.start(env=env, app="jetloop.demo.agent:app")
        assert (await client.wait(h, timeout=60)).text == "Ticket T-1 is open."

        async def turn_span() -> bool:
            return bool(otlp.named("invoke_agent "))

        await until(turn_span, timeout=15)
        spans = list(otlp.spans)

    assert {s.trace_id for s in spans} == {CALLER_TRACE}, "one trace, the caller's"
    (turn,) = [s for s in spans if s.name == "invoke_agent demo"]
    assert turn.parent_span_id == CALLER_SPAN
    assert turn.attributes["jetloop.turn_id"] == h.turn_id
    assert turn.attributes["gen_ai.usage.input_tokens"] == 320
    assert turn.attributes["gen_ai.usage.output_tokens"] == 70
    assert turn.attributes["jetloop.status"] == "completed"
    # The turn's span holds every step's: from its acceptance to its end (before: from its
    # last model step's first attempt, after its first children had begun).
    children = [s for s in spans if s.parent_span_id == turn.span_id]
    assert len(children) >= 3
    assert turn.start_ns <= min(s.start_ns for s in children)
    assert turn.end_ns >= max(s.end_ns for s in children)

    chats = sorted(
        (s for s in spans if s.name == f"chat {MODEL}"),
        key=lambda s: s.attributes["jetloop.step_key"],
    )
    assert [s.attributes["jetloop.step_key"] for s in chats] == [
        f"tr.{h.turn_id}.m0",
        f"tr.{h.turn_id}.m1",
    ]
    for s, (inp, out, why) in zip(chats, [(120, 30, "tool_calls"), (200, 40, "stop")], strict=True):
        assert s.parent_span_id == turn.span_id
        assert s.attributes["gen_ai.operation.name"] == "chat"
        assert s.attributes["gen_ai.request.model"] == MODEL
        assert s.attributes["gen_ai.usage.input_tokens"] == inp
        assert s.attributes["gen_ai.usage.output_tokens"] == out
        assert s.attributes["gen_ai.response.finish_reasons"] == [why]

    tools = [s for s in spans if s.name == "execute_tool create_ticket"]
    # The first attempt's span died with its worker; the one made again is linked to it.
    (again,) = tools
    assert again.parent_span_id == turn.span_id
    assert again.attributes["jetloop.attempt"] == 2 and again.attributes["jetloop.repeated"]
    assert again.attributes["jetloop.effect"] == "idempotent_write"
    assert again.attributes["jetloop.idempotency_key"].startswith("jl-")
    assert again.attributes["gen_ai.tool.name"] == "create_ticket"
    assert again.attributes["jetloop.outcome"] == "succeeded"
    assert all(s.attributes["jetloop.outcome"] == "succeeded" for s in chats)
    ((link_trace, link_span, link_attrs),) = again.links
    first = attempt_span_id(f"tr.{h.turn_id}.m0.c0", 1)
    assert (link_trace, link_span) == (CALLER_TRACE, f"{first:016x}")
    assert link_attrs == {"jetloop.link": "first attempt"}


async def test_a_malformed_traceparent_is_refused(client: Client) -> None:
    with pytest.raises(ValueError, match="not W3C trace context"):
        await client.send(
            "demo", "bad", "hi", traceparent="00-" + "0" * 32 + "-" + "1" * 16 + "-01"
        )


def test_without_an_endpoint_nothing_of_opentelemetry_is_imported() -> None:
    """A worker's modules, the demo app and the client load no OpenTelemetry module: tracing
    off costs an import nothing (and a step one None check)."""
    code = (
        "import sys, jetloop.services.worker, jetloop.demo.agent, jetloop.services.client;"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


async def test_waits_are_spans_of_their_own(client: Client, workers: WorkerFactory) -> None:
    """A call held for approval, a timer and a question: each wait is a span from when it
    began to when it ended, under the turn's span (the demo's scripted model, no provider)."""
    async with OtlpReceiver() as otlp:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        workers.start(env=env, app="jetloop.demo.agent:app")
        held = await client.send("demo", "tw", "close T-1")

        async def pending() -> str | None:
            snap = await client.snapshot("tw")
            waiting = [a for a in snap.approvals if a.status == "pending"] if snap else []
            return waiting[0].approval_id if waiting else None

        await client.approve("tw", await until(pending), by="boss")
        await client.wait(held, timeout=30)
        timed = await client.send("demo", "tw2", "wait 1 seconds")
        await client.wait(timed, timeout=30)
        asked = await client.send("demo", "tw3", "ask me what colour the printer is")

        async def question() -> str | None:
            snap = await client.snapshot("tw3")
            open_ = [q for q in snap.questions if not q.answered] if snap else []
            return open_[0].question_id if open_ else None

        await client.answer("tw3", await until(question), "beige", by="boss")
        await client.wait(asked, timeout=30)

        async def both() -> bool:
            return len(otlp.named("invoke_agent ")) >= 3 and len(otlp.named("await_")) >= 3

        await until(both, timeout=15)
        spans = list(otlp.spans)
    turns = {s.attributes["jetloop.session_id"]: s for s in spans if s.name.startswith("invoke")}
    (approval,) = [s for s in spans if s.name == "await_approval close_ticket"]
    assert approval.parent_span_id == turns["tw"].span_id
    assert approval.attributes["jetloop.decision"] == "approved"
    assert approval.attributes["jetloop.decided_by"] == "boss"
    (timer,) = [s for s in spans if s.name.startswith("await_timer")]
    assert timer.parent_span_id == turns["tw2"].span_id
    assert timer.end_ns - timer.start_ns >= 0.9e9, "the span covers the second waited"
    assert turns["tw2"].start_ns <= timer.start_ns and turns["tw2"].end_ns >= timer.end_ns
    (answer,) = [s for s in spans if s.name.startswith("await_answer")]
    assert answer.parent_span_id == turns["tw3"].span_id


async def test_console_exporter_prints_the_turns_spans(
    client: Client, workers: WorkerFactory
) -> None:
    """``OTEL_TRACES_EXPORTER=console`` (the standard variable), no collector: the worker
    prints each span as JSON on its output, the turn's among them (before: ignored, and
    traces needed an OTLP endpoint to be seen at all)."""
    w = workers.start(env={"OTEL_TRACES_EXPORTER": "console"}, app="jetloop.demo.agent:app")
    h = await client.send("demo", "tc", "list tickets")
    await client.wait(h, timeout=30)

    async def printed() -> bool:
        return '"name": "invoke_agent demo"' in w.log_path.read_text(errors="replace")

    await until(printed, timeout=15)
    text = w.log_path.read_text(errors="replace")
    assert '"name": "chat ' in text
    assert f'"jetloop.turn_id": "{h.turn_id}"' in text
