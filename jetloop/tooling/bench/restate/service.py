"""The 7-step turn as a Restate service, served by hypercorn (``hypercorn
jetloop.tooling.bench.restate.service:app``) for ``jetloop bench peer``.

The turn mirrors ``jetloop.tooling.bench.app``'s ``fan 5`` and the DBOS peer's workflow: a model
step that answers at once asking for five calls, five no-op tool steps, a model step that
answers. Each step is a durable step of Restate (``ctx.run_typed``, which the SDK recommends
over the older ``ctx.run``): the server journals its result before the handler goes on, and a
replay reads it back instead of running the step again. The five tool steps are started
together in call order (the journal numbers them in that order) and awaited with
``restate.gather``, so they run, and are journaled, concurrently.

Imported only in the hypercorn process: ``restate-sdk`` is an optional extra (the ``peer``
extra) and never loaded by jetloop itself.
"""

from __future__ import annotations

from typing import Any

import restate

turn = restate.Service("turn")


async def model(text: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """As ``bench_app.fan_script``: ``fan <n>`` asks for n no-op calls, then answers."""
    words = text.split()
    if not results and len(words) == 2 and words[0] == "fan":
        calls = [{"name": "noop", "arguments": {}} for _ in range(int(words[1]))]
        return {"text": "calling", "tool_calls": calls}
    return {"text": "ok", "tool_calls": []}


async def noop(arguments: dict[str, Any]) -> dict[str, Any]:
    return {"ok": True}


@turn.handler()  # type: ignore[untyped-decorator, unused-ignore]  # untyped without the extra
async def run(ctx: restate.Context, text: str) -> str:
    """One turn: model step, the calls it asked for in parallel, model step."""
    first = await ctx.run_typed("model", model, text=text, results=[])
    calls = [ctx.run_typed("noop", noop, arguments=c["arguments"]) for c in first["tool_calls"]]
    done = await restate.gather(*calls)
    results = [await f for f in done]
    answer = await ctx.run_typed("model", model, text=text, results=results)
    return str(answer["text"])


app = restate.app([turn])
