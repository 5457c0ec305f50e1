"""The web console (issue 18) in a real browser: headless Chromium, driven by Playwright
through Debian's ``chromium`` (its own browser download is not used), against `jetloop up`
as a subprocess with its own store, free ports and two tokens: one that may approve, one
that may only read.

One test walks the pages a person uses, in the order they would: sign in, send the demo a
message that needs an approval, find it in the inbox, approve it, watch the turn's timeline
reach ``completed``; answer a question; find a dead letter after a malformed request; see
the operations figures; then sign in read-only and find no approve button. Screenshots of
every page are saved under ``test-artifacts/console/`` (git-ignored; the README names it).

Without Chromium or Playwright the test is skipped, saying which is missing.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import pytest

from jetloop.schemas import Event, EventType, encode
from jetloop.services.client import Client
from jetloop.services.embedded import free_port
from jetloop.services.natsauth import url_as
from jetloop.streams.topology import event_subject
from tests.test_up import events, field

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts" / "console"
CHROMIUM = os.environ.get("JETLOOP_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
BOSS, VIEWER = "boss-token-0123456789", "viewer-token-0123456789"
TOKENS = {
    BOSS: {"name": "boss", "scopes": ["read", "write", "approve"]},
    VIEWER: {"name": "viewer", "scopes": ["read"]},
}
WAIT_MS = 20_000

try:
    from playwright.sync_api import Browser, Page, expect, sync_playwright
except ImportError:  # pragma: no cover - depends on the machine
    sync_playwright = None  # type: ignore[assignment]

pytestmark = [
    pytest.mark.skipif(
        sync_playwright is None, reason="playwright is not installed (pip install playwright)"
    ),
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(),
        reason=f"no Chromium at {CHROMIUM} (apt-get install -y chromium, or set JETLOOP_CHROMIUM)",
    ),
    pytest.mark.timeout(150),
]


def running_up(store: Path, log: Path, env: dict[str, str], nats_port: int) -> Iterator[str]:
    """`jetloop up` as a process of its own (its own session, so Ctrl-C reaches its whole
    tree) on ``store``, logging to ``log``: yields its gateway's URL once it says it is up,
    and is stopped with Ctrl-C after (SIGKILL to its group if it will not stop)."""
    cmd = [sys.executable, "-m", "jetloop.services.cli", "up", "--nats-port", str(nats_port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*cmd, "--store-dir", str(store)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        while not events(log, "jetloop.up"):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield field(events(log, "jetloop.up")[-1], "gateway")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def up(tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """`jetloop up` with tokens: (gateway URL, NATS URL, store), stopped with Ctrl-C after."""
    port = free_port()
    store = tmp_path / "store"
    env = {
        **os.environ,
        "JETLOOP_VENDOR_DB": str(tmp_path / "vendor.sqlite"),
        "JETLOOP_GATEWAY_PORT": "0",
        "JETLOOP_GATEWAY_TOKENS": json.dumps(TOKENS),
    }
    for gateway in running_up(store, tmp_path / "up.log", env, port):
        yield gateway, f"nats://127.0.0.1:{port}", store


@pytest.fixture
def browser() -> Iterator[Browser]:
    """Chromium with a fresh profile (Playwright's launch makes a temporary one each time)."""
    assert sync_playwright is not None
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        try:
            yield b
        finally:
            b.close()


def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def sign_in(page: Page, gateway: str, token: str) -> None:
    page.goto(gateway + "/")
    page.locator("#token").fill(token)
    page.locator("#signin-form button[type=submit]").click()
    expect(page.locator("#nav")).to_be_visible(timeout=WAIT_MS)


def post(gateway: str, path: str, body: dict[str, Any], token: str) -> Any:
    req = urllib.request.Request(
        gateway + path,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


async def publish_malformed(nats_url: str, store: Path) -> None:
    """A turn request no worker can read: it is dead-lettered with its reason."""
    c = await Client.connect(url_as(nats_url, store))
    try:
        bad = {"text": "hi", "metadata": {"parent": {"x": 1}}}
        await c.js.publish(
            "jl.turn.demo.malformed", msgpack.packb(bad), headers={"Nats-Msg-Id": "malformed.1"}
        )
    finally:
        await c.close()


async def publish_unknown_outcome(nats_url: str, store: Path) -> None:
    """The log of a turn whose write call ended ``outcome_unknown``. Written as the worker
    writes it (the events alone: no state record, so it cannot be reconciled here); a real
    one takes a worker killed inside a write (tests/test_crash.py)."""
    c = await Client.connect(url_as(nats_url, store))
    sid, tid, now = "web-unknown", "tunknown", time.time()
    key = f"{sid}.{tid}.0.0"
    facts: list[tuple[EventType, dict[str, Any]]] = [
        (EventType.TURN_ACCEPTED, {"request_id": "r-unknown", "queued": False}),
        (EventType.TURN_STARTED, {"request_id": "r-unknown", "agent": "demo"}),
        (
            EventType.MODEL_ANSWERED,
            {
                "model_step": 0,
                "usage": {"input_tokens": 812, "output_tokens": 44},
                "calls": [
                    {"call_id": "c0", "tool": "refund", "args": {"amount": 40}, "effect": "write"}
                ],
            },
        ),
        (
            EventType.CALL_OUTCOME,
            {
                "call_key": key,
                "tool": "refund",
                "effect": "write",
                "state": "outcome_unknown",
                "attempts": 2,
                "error": "the worker was lost inside the call",
            },
        ),
    ]
    try:
        for n, (kind, data) in enumerate(facts):
            e = Event(
                key=f"{tid}.{n}", type=kind, session_id=sid, turn_id=tid, at=now + n, data=data
            )
            await c.js.publish(event_subject(sid, kind.value), encode(e))
    finally:
        await c.close()


def test_console_in_a_browser(up: tuple[str, str, Path], browser: Browser) -> None:
    """Sign in; a demo message that needs an approval shows in the inbox and is approved
    there; its timeline reaches completed with the decision and who made it; a question is
    answered; a malformed request shows as a dead letter with its reason; a read-only token
    sees no approve button."""
    gateway, nats_url, store = up
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    # The sign-in page; the token goes to sessionStorage, never into the URL.
    page.goto(gateway + "/")
    expect(page.locator("#signin-form")).to_be_visible(timeout=WAIT_MS)
    shot(page, "01-sign-in")
    sign_in(page, gateway, BOSS)
    expect(page.locator("#whoami")).to_contain_text("boss")
    assert BOSS not in page.url
    assert page.evaluate("sessionStorage.getItem('jetloop.token')") == BOSS

    # Chat: a message whose close_ticket call is held for approval.
    page.goto(gateway + "/#/chat?session=web-approve&agent=demo")
    page.locator("#chat-text").fill("create ticket printer on fire; close T-1")
    page.locator("#chat-send").click()
    expect(page.locator("#chat-log")).to_contain_text("waits for approval", timeout=WAIT_MS)
    shot(page, "02-chat-approval")
    turn_id = page.locator("#chat-log a.turn-link").first.inner_text()

    # Inbox: the approval, approved here; the decision's author is the token's name.
    page.goto(gateway + "/#/inbox")
    item = page.locator('#inbox [data-kind="approval"][data-session="web-approve"]')
    expect(item).to_be_visible(timeout=WAIT_MS)
    expect(item).to_contain_text("close_ticket")
    shot(page, "03-inbox")
    item.locator("input.reason").fill("ticket is done")
    item.locator("button.approve").click()
    expect(item).to_have_count(0, timeout=WAIT_MS)

    # The turn's timeline reaches completed, with the approval and who decided it.
    page.goto(f"{gateway}/#/turn/web-approve/{turn_id}")
    expect(page.locator("#turn-status")).to_contain_text("completed", timeout=WAIT_MS)
    timeline = page.locator("#timeline")
    expect(timeline.locator('[data-type="approval.decided"]')).to_contain_text("boss")
    expect(timeline.locator('[data-type="approval.decided"]')).to_contain_text("ticket is done")
    expect(timeline.locator('[data-type="model.answered"]').first).to_contain_text("usage")
    expect(timeline.locator('[data-type="model.usage"]').first).to_contain_text("tokens")
    expect(page.locator("#turn-usage")).to_contain_text("model call(s)")
    expect(timeline.locator('[data-type="call.outcome"]').first).to_contain_text("jl-")
    expect(page.locator("#calls")).to_contain_text("idempotent_write")
    shot(page, "04-timeline")

    # A question, answered from the inbox.
    ask = post(
        gateway,
        "/v1/agents/demo/sessions/web-question/messages",
        {"text": "ask me what colour the printer is"},
        BOSS,
    )
    page.goto(gateway + "/#/inbox")
    q = page.locator('#inbox [data-kind="question"][data-session="web-question"]')
    expect(q).to_be_visible(timeout=WAIT_MS)
    q.locator("input.answer-text").fill("beige")
    q.locator("button.answer").click()
    expect(q).to_have_count(0, timeout=WAIT_MS)
    page.goto(f"{gateway}/#/turn/web-question/{ask['turn_id']}")
    expect(page.locator("#turn-status")).to_contain_text("completed", timeout=WAIT_MS)
    expect(page.locator('#timeline [data-type="question.answered"]')).to_contain_text("beige")

    # Sessions: the list with status and agent, and its search.
    page.goto(gateway + "/#/sessions")
    expect(page.locator('#sessions [data-session="web-approve"]')).to_contain_text("demo")
    expect(page.locator("#sessions-total")).to_contain_text("of 2", timeout=WAIT_MS)
    shot(page, "05-sessions")
    page.locator('#sessions [data-session="web-approve"]').click()
    expect(page.locator(f'#turns [data-turn="{turn_id}"]')).to_contain_text("completed")
    expect(page.locator("#session-usage")).to_contain_text("model call(s)")
    shot(page, "05b-session")
    page.goto(gateway + "/#/sessions")
    page.locator("#search").fill("question")
    page.locator("#search").press("Enter")
    expect(page.locator("#sessions-total")).to_contain_text("of 1", timeout=WAIT_MS)
    expect(page.locator('#sessions [data-session="web-question"]')).to_be_visible()

    # A malformed request: a dead letter with its reason, on the operations page.
    # (Playwright's sync API has a loop of its own in this thread: publish from another.)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, publish_malformed(nats_url, store)).result(30)
    page.goto(gateway + "/#/ops")
    letter = page.locator("#dead-letters .dead-letter").first
    for _ in range(20):  # the page reads JL_DEAD when it opens
        if letter.count():
            break
        page.wait_for_timeout(500)
        page.reload()
    expect(letter).to_contain_text("jl.turn.demo.malformed", timeout=WAIT_MS)
    expect(letter.locator(".reason")).to_contain_text("TurnRequest invalid")
    expect(page.locator("#workers")).to_contain_text("demo")
    assert "held." not in page.locator("#workers").inner_text()
    expect(page.locator("#consumers")).to_contain_text("jl_turns_demo")
    expect(page.locator("#charts .legend").nth(1)).to_contain_text("p99", timeout=WAIT_MS)
    # Some steps while the page samples /metrics every 2 s: the charts draw them.
    for n in range(3):
        post(
            gateway,
            f"/v1/agents/demo/sessions/web-load-{n}/messages",
            {"text": "list tickets"},
            BOSS,
        )
        page.wait_for_timeout(1500)
    expect(page.locator("#charts polyline").first).to_have_attribute("points", re.compile(r"\d"))
    shot(page, "06-operations")

    # An outcome_unknown call: its timeline says so, with the reconcile action.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, publish_unknown_outcome(nats_url, store)).result(30)
    page.goto(f"{gateway}/#/turn/web-unknown/tunknown")
    banner = page.locator("[data-outcome-unknown]").first
    expect(banner).to_contain_text("OUTCOME UNKNOWN", timeout=WAIT_MS)
    expect(banner).to_contain_text("Reconcile")
    expect(banner.locator("button")).to_have_count(2)
    expect(page.locator('#timeline [data-type="model.answered"]')).to_contain_text("812")
    shot(page, "07-outcome-unknown")

    # Read-only: a held approval, and no approve button for this token.
    post(gateway, "/v1/agents/demo/sessions/web-held/messages", {"text": "close T-1"}, BOSS)
    viewer = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    sign_in(viewer, gateway, VIEWER)
    expect(viewer.locator("#whoami")).to_contain_text("viewer")
    viewer.goto(gateway + "/#/inbox")
    held = viewer.locator('#inbox [data-kind="approval"][data-session="web-held"]')
    expect(held).to_be_visible(timeout=WAIT_MS)
    expect(held.locator("[data-no-approve]")).to_be_visible()
    assert viewer.locator("button.approve").count() == 0
    shot(viewer, "08-inbox-read-only")
    assert errors == [], errors
    viewer.goto(gateway + "/#/sessions?status=approval")
    expect(viewer.locator('#sessions [data-session="web-held"]')).to_contain_text(
        "waiting for approval", timeout=WAIT_MS
    )
    viewer.goto(f"{gateway}/#/turn/web-unknown/tunknown")
    expect(viewer.locator("[data-outcome-unknown]").first).to_contain_text(
        "reconciling needs the approve scope", timeout=WAIT_MS
    )
    viewer.goto(gateway + "/#/chat")
    expect(viewer.locator("#chat-send")).to_be_disabled()

    # A signed-out tab (no token) is asked to sign in again.
    viewer.locator("#signout").click()
    expect(viewer.locator("#signin-form")).to_be_visible(timeout=WAIT_MS)


def test_the_tokenless_console_opens_every_namespace(tmp_path: Path, browser: Browser) -> None:
    """`jetloop up` without tokens on loopback: the console needs no sign-in, offers every
    namespace of the store (one made while it runs too), and shows the chosen one's sessions
    (before: 403 "the token may not act in 'acme'" with no token sent)."""
    store = tmp_path / "store"
    env = {
        **os.environ,
        "JETLOOP_VENDOR_DB": str(tmp_path / "vendor.sqlite"),
        "JETLOOP_GATEWAY_PORT": "0",
        "JETLOOP_STORE_DIR": str(store),
    }

    def cli(*args: str) -> None:
        ran = subprocess.run(
            [sys.executable, "-m", "jetloop.services.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert ran.returncode == 0, ran.stderr

    errors: list[str] = []
    for gateway in running_up(store, tmp_path / "up.log", env, free_port()):
        cli("namespace", "create", "acme")  # back once up serves it
        cli("--namespace", "acme", "send", "--agent", "demo", "--session", "acme-s1", "hi")
        cli("send", "--agent", "demo", "--session", "home-s1", "hi")
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(gateway + "/#/sessions")
        expect(page.locator("#whoami")).to_contain_text("anonymous", timeout=WAIT_MS)
        expect(page.locator('#sessions [data-session="home-s1"]')).to_be_visible(timeout=WAIT_MS)
        choice = page.locator("#namespace")
        expect(choice.locator("option")).to_have_count(2)
        choice.select_option("acme")
        expect(page.locator('#sessions [data-session="acme-s1"]')).to_be_visible(timeout=WAIT_MS)
        expect(page.locator('#sessions [data-session="home-s1"]')).to_have_count(0)
        shot(page, "09-tokenless-namespace")
        assert errors == [], errors
