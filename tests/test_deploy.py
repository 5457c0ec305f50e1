"""Deploying new agent code under turns in flight (issue 33): the workers of app v1 replaced
by workers of app v2, which removed tools, changed a tool's arguments and made a task a plain
call (``tests.apps.removed_app``, ``tests.apps.changed_app``).

Each call in flight ends as docs/design.md, "Deploying new agent code", says: a person's
decision on a removed tool's approval is kept (a rejection stays a denial; an approval says
the tool is gone and nothing ran), work that was started is never called "safe to call
again" (a started task is ``outcome_unknown``), and a call whose arguments no longer fit
fails with that reason for the model to see: never a dead letter, a failed turn or a stuck
one.
"""

from __future__ import annotations

from jetloop.demo.vendor import Vendor
from jetloop.services.client import Client
from jetloop.streams import topology
from tests.conftest import WorkerFactory, body, call, script, until
from tests.test_resume import pending_approval

PREFIX = "the tool did not run, so it is safe to call again"


async def no_dead_letters(client: Client) -> None:
    info = await client.js.stream_info(topology.DEAD_STREAM)
    assert info.state.messages == 0, info.state


async def test_a_decision_on_a_removed_tools_approval_is_kept(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """Two calls of `guarded` wait for approval when v2, without `guarded`, replaces v1: the
    one rejected afterwards ends denied, by whom and why; the one approved afterwards fails
    saying who approved it and that the agent no longer offers the tool; neither ran."""
    v1 = workers.start("v1")
    rejected = await client.send("tester", "dr", script([call("guarded", name="r")]))
    approved = await client.send("tester", "da", script([call("guarded", name="a")]))
    to_reject = await pending_approval(client, "dr")
    to_approve = await pending_approval(client, "da")
    v1.kill()
    workers.start("v2", app="tests.apps:removed_app")

    await client.reject("dr", to_reject, by="carol", reason="not today")
    [seen] = body((await client.wait(rejected, timeout=30)).text)["seen"]
    assert seen["status"] == "denied", seen
    assert "carol" in seen["error"] and "not today" in seen["error"], seen

    await client.approve("da", to_approve, by="dave")
    [seen] = body((await client.wait(approved, timeout=30)).text)["seen"]
    assert seen["status"] == "error", seen
    assert seen["error"].startswith(PREFIX), seen
    assert "approved by dave" in seen["error"] and "no longer offers" in seen["error"], seen
    assert await vendor.effect_count("guarded") == 0
    await no_dead_letters(client)


async def started_task(client: Client, vendor: Vendor, session: str) -> None:
    async def polled() -> bool:
        return sum((await vendor.request_counts("task_poll")).values()) >= 1

    await until(polled)


async def test_a_started_task_of_a_removed_tool_is_outcome_unknown(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A task v1 started (and polls) when v2, without the tool, takes over: it may be
    running at the vendor, so its outcome is unknown, never "safe to call again"."""
    v1 = workers.start("v1")
    h = await client.send("tester", "dt", script([call("export", name="e", polls=10_000)]))
    await started_task(client, vendor, "dt")
    v1.kill()
    workers.start("v2", app="tests.apps:removed_app")
    [seen] = body((await client.wait(h, timeout=60)).text)["seen"]
    assert seen["status"] == "outcome_unknown", seen
    assert PREFIX not in seen["error"] and "export" in seen["error"], seen
    assert sum((await vendor.request_counts("task_start")).values()) == 1
    await no_dead_letters(client)


async def test_a_task_that_became_a_plain_call_is_outcome_unknown(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """v2 made `export` a plain call: the task v1 started cannot be polled by it, so its
    outcome is unknown (before: an assertion, five tries, a dead letter and a failed turn)."""
    v1 = workers.start("v1")
    h = await client.send("tester", "dc", script([call("export", name="e", polls=10_000)]))
    await started_task(client, vendor, "dc")
    v1.kill()
    workers.start("v2", app="tests.apps:changed_app")
    [seen] = body((await client.wait(h, timeout=60)).text)["seen"]
    assert seen["status"] == "outcome_unknown", seen
    assert "no longer a task" in seen["error"], seen
    assert sum((await vendor.request_counts("export_call")).values()) == 0
    await no_dead_letters(client)


async def test_a_call_whose_arguments_no_longer_fit_fails_for_the_model(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """v1 asked for `write(name=…)` and died before making it; v2's `write` takes `title`:
    the call fails with the reason (it did not run), the model answers, the turn completes
    (before: a dead letter and a failed turn)."""
    v1 = workers.start("v1", hold="call_tool.before_mark")
    h = await client.send("tester", "dw", script([call("write", name="w")]))
    await v1.wait_for("fault.hold")
    v1.kill()
    workers.start("v2", app="tests.apps:changed_app")
    [seen] = body((await client.wait(h, timeout=60)).text)["seen"]
    assert seen["status"] == "error", seen
    assert seen["error"].startswith(PREFIX) and "no longer fit" in seen["error"], seen
    assert "title" in seen["error"], seen
    assert await vendor.effect_count("write") == 0
    await no_dead_letters(client)
