"""Changing a session's approval policy is a decision like the others (issue 51): it is
recorded with who made it, when and from what, in the session record and as an
``approval.policy_changed`` event; and only the workers' role may make it: the ``client``
credential (and any named identity) is refused by the server, by the control service and
by the Python client, so a tool that needs approval still waits for it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.errors import TimeoutError as NatsTimeoutError

from jetloop.demo.vendor import Vendor
from jetloop.schemas import Event
from jetloop.schemas.errors import ControlError
from jetloop.services.client import Client
from jetloop.services.natsauth import client_permissions, make_users, url_as
from jetloop.streams.connection import connect, inbox_prefix
from jetloop.streams.seal import Sealer, key_bytes
from tests.conftest import until
from tests.test_nats_auth import NO_CREDENTIALS, REFUSED_WAIT, cli_elsewhere
from tests.test_seal_key import Up, env_without_key
from tests.test_up import wait_ready

TOOL = "close_ticket"  # the demo agent's tool that needs approval ("close T-1")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    u = Up(tmp_path_factory.mktemp("policy"))
    u.start()
    try:  # stopped also when it never became ready
        assert u.proc is not None
        wait_ready(u.proc, u.log)
        yield u
    finally:
        u.stop()


def cli(up: Up, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in up's working directory: the store's (workers') credential."""
    env = {k: v for k, v in env_without_key().items() if k not in NO_CREDENTIALS}
    return subprocess.run(
        [sys.executable, "-m", "jetloop.services.cli", *args, "--nats", up.url],
        cwd=up.cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def policy_events(c: Client, session: str) -> list[Event]:
    return [e async for e in c.events(session, ["approval.policy_changed"], follow=False)]


def as_client(up: Up) -> dict[str, str]:
    store = up.cwd / ".jetloop"
    return {"JETLOOP_NATS_USER": "client", "JETLOOP_NATS_PASSWORD": make_users(store)["client"]}


async def as_client_role(up: Up) -> Client:
    """A program elsewhere with the ``client`` credential and no seal key."""
    url = url_as(up.url, up.cwd / ".jetloop", "client")
    return Client(await connect([url], "test-policy-client"), own=True, verify=False)


async def test_a_policy_change_is_recorded_with_who_when_and_an_event(up: Up) -> None:
    """The local CLI waives approval of a tool: the session record keeps the change (by, at,
    before and after), one ``approval.policy_changed`` event tells it, and the CLI shows
    it; setting the same again changes nothing and writes no second event."""
    before = time.time()
    out = await asyncio.to_thread(
        cli, up, "policy", "pa", TOOL, "--waive", "--agent", "demo", "--by", "ops-ann"
    )
    assert out.returncode == 0, out.stderr
    after = time.time()
    assert f"{TOOL}: approval waived (set by ops-ann at " in out.stdout, out.stdout
    assert "was its own policy)" in out.stdout, out.stdout

    async with await up.client() as c:
        snap = await c.snapshot("pa")  # a sealed record that verifies
        assert snap is not None and snap.untrusted == [], snap
        assert snap.approval_overrides == {TOOL: False}
        change = snap.approval_changes[TOOL]
        assert (change.required, change.previous, change.by) == (False, None, "ops-ann")
        assert before <= change.at <= after

        events = await until(lambda: policy_events(c, "pa"))
        assert len(events) == 1, events
        data = events[0].data
        assert data == {"tool": TOOL, "required": False, "previous": None, "by": "ops-ann"}
        assert events[0].at == change.at and events[0].turn_id is None

        again = await asyncio.to_thread(cli, up, "policy", "pa", TOOL, "--waive", "--by", "bo")
        assert again.returncode == 0, again.stderr
        assert "set by ops-ann" in again.stdout, again.stdout  # the first change stands
        await c.set_approval("pa", TOOL, True, by="ops-cy")
        events = await until(
            lambda: _at_least(policy_events(c, "pa"), 2)  # the waive again wrote none
        )
        assert [(e.data["by"], e.data["previous"], e.data["required"]) for e in events] == [
            ("ops-ann", None, False),
            ("ops-cy", False, True),
        ]
        shown = await asyncio.to_thread(cli, up, "events", "pa", "--no-follow")
        assert f"approval of {TOOL} required by ops-cy" in shown.stdout, shown.stdout


async def _at_least(events: Any, n: int) -> Any:
    got = await events
    return got if len(got) >= n else None


def test_no_named_identity_may_publish_a_policy_change() -> None:
    """The server's permissions for the client role and every named identity deny the
    privileged subject ``jl.control.approval_policy.<who>`` and keep the other decisions."""
    for who in ("client", "carol"):
        publish = client_permissions(who)["publish"]
        assert f"jl.control.approval_policy.{who}" in publish["deny"]
        assert f"jl.control.*.{who}" in publish["allow"]
        assert not any(s.startswith("jl.control.approve") for s in publish["deny"])


async def test_the_client_credential_may_not_change_a_policy(up: Up, tmp_path: Path) -> None:
    """With the ``client`` credential, a waive is refused everywhere, naming the role it
    needs: the server refuses the raw NATS request (a permissions violation, no answer);
    the Python client and the CLI say 403 at once; and the control service refuses it too
    when it does arrive (defence in depth). Nothing is recorded."""
    store = up.cwd / ".jetloop"
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    nc = await nats.connect(
        url_as(up.url, store, "client"),
        inbox_prefix=inbox_prefix("client"),
        error_cb=on_error,
        max_reconnect_attempts=0,
    )
    body = json.dumps({"session_id": "pr", "tool": TOOL, "required": False, "agent": "demo"})
    try:
        with pytest.raises(NatsTimeoutError):
            await nc.request("jl.control.approval_policy.client", body.encode(), REFUSED_WAIT)
        await nc.flush()
        assert any(
            "permissions violation" in e and "jl.control.approval_policy.client" in e
            for e in errors
        ), errors

    finally:
        await nc.close()

    async with await as_client_role(up) as c:
        with pytest.raises(ControlError) as refused:
            await c.set_approval("pr", TOOL, False, agent="demo")
        assert refused.value.status == 403, refused.value
        assert "workers' role" in refused.value.detail, refused.value

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = await asyncio.to_thread(
        cli_elsewhere, up.url, elsewhere, "policy", "pr", TOOL, "--waive", **as_client(up)
    )
    assert out.returncode == 1, out
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("Error: not allowed: approval_policy needs the workers' role"), line

    async with await up.client() as c:
        # As if the server had let it through: the workers refuse it themselves.
        reply = await c.nc.request("jl.control.approval_policy.client", body.encode(), 10)
        answer = json.loads(reply.data)
        assert answer["ok"] is False and answer["error"]["status"] == 403, answer
        assert "workers' role" in answer["error"]["detail"], answer
        assert await c.snapshot("pr") is None  # no session made, nothing recorded
        assert await policy_events(c, "pr") == []


async def test_the_client_credential_beside_the_store_decides_through_the_workers(
    up: Up,
) -> None:
    """A program with the ``client`` credential that also holds the seal key (beside the
    store: the CLI and the client find ``seal.key`` there) may not write state: it asks the
    workers, so its decision is recorded as the client's within seconds, and its policy
    change is refused 403 at once — not a server refusal of its writes waited out until a
    timeout."""
    url = url_as(up.url, up.cwd / ".jetloop", "client")
    sealer = Sealer([key_bytes((up.cwd / ".jetloop" / "seal.key").read_text().strip())])
    async with Client(await connect([url], "test-beside"), own=True, sealer=sealer) as c:
        started = time.monotonic()
        with pytest.raises(ControlError) as refused:
            await c.set_approval("pb", TOOL, False, agent="demo")
        assert refused.value.status == 403, refused.value
        await c.send("demo", "pb", "close T-1")

        async def held() -> Any:
            snap = await c.snapshot("pb")
            pending = [a for a in snap.approvals if a.status == "pending"] if snap else []
            return pending or None

        [approval] = await until(held, timeout=30)
        # Rejected, not approved: the module's `up` is shared, and another test counts that
        # the vendor saw no close.
        decided = await c.reject("pb", approval.approval_id, by="someone")
        assert decided.decided_by == "client", decided
        assert time.monotonic() - started < 20


async def test_after_a_refused_waive_close_still_waits_for_approval(up: Up) -> None:
    """The issue's path: the client credential tries to waive approval of ``close_ticket``
    and is refused; its next ``close T-1`` waits for approval and closes nothing."""
    async with await as_client_role(up) as c:
        with pytest.raises(ControlError):
            await c.set_approval("pw", TOOL, False, agent="demo")
        await c.send("demo", "pw", "close T-1")

        async def held() -> Any:
            snap = await c.snapshot("pw")
            pending = [a for a in snap.approvals if a.status == "pending"] if snap else []
            return pending or None

        [approval] = await until(held, timeout=30)
        assert approval.tool == TOOL
        snap = await c.snapshot("pw")
        assert snap is not None and snap.approval_overrides == {}, snap
    closes = await Vendor(up.cwd / "vendor.sqlite").request_counts(TOOL)
    assert sum(closes.values()) == 0, closes
