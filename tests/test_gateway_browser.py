"""A web page cannot drive a token-less `jetloop up` (issue 29, finding 4).

Against one real `jetloop up` without tokens (every scope to anonymous requests on
loopback): requests as a browser would send them are refused before they reach a handler:
another origin (403), another Host (421, DNS rebinding), a body that is not JSON (415);
the same requests as the gateway's own page sends them, and the console, keep working.
The browser tests drive Debian's Chromium through Playwright (skipped without them): a page
served from another port posts to the gateway with ``fetch(…, {mode: "no-cors"})`` and with
a form, and a page whose name resolves to 127.0.0.1 posts as "the same origin"; no turn
starts.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jetloop.services.embedded import free_port
from tests.test_console import CHROMIUM, running_up

try:
    from playwright.sync_api import Browser, expect, sync_playwright
except ImportError:  # pragma: no cover - depends on the machine
    sync_playwright = None  # type: ignore[assignment]

WAIT_MS = 20_000
MESSAGES = "/v1/agents/demo/sessions/{}/messages"
JSON = {"Content-Type": "application/json"}

pytestmark = pytest.mark.timeout(90)
needs_browser = pytest.mark.skipif(
    sync_playwright is None or not Path(CHROMIUM).exists(),
    reason=f"needs playwright and Chromium at {CHROMIUM} (apt-get install -y chromium)",
)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`jetloop up` with no token configured (its default): the gateway's URL."""
    tmp = tmp_path_factory.mktemp("up")
    log = tmp / "up.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETLOOP_")}
    env |= {
        "JETLOOP_VENDOR_DB": str(tmp / "vendor.sqlite"),
        "JETLOOP_GATEWAY_PORT": "0",
        "JETLOOP_LOG_FORMAT": "console",
    }
    yield from running_up(tmp / "store", log, env, free_port())


def call(
    gateway: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """One request with exactly these headers (``Host`` included, when given)."""
    hostport = gateway.removeprefix("http://")
    conn = http.client.HTTPConnection(hostport, timeout=40)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        raw = resp.read()
        is_json = "json" in resp.getheader("Content-Type", "")
        return resp.status, json.loads(raw) if raw and is_json else raw
    finally:
        conn.close()


def no_session(gateway: str, session: str) -> bool:
    status, got = call(gateway, "GET", f"/v1/sessions/{session}")
    assert status == 404, (status, got)
    return True


def sends_answered(gateway: str, status: int) -> float:
    """How many sends the gateway has answered with ``status`` (its own metrics)."""
    _, text = call(gateway, "GET", "/metrics")
    route = MESSAGES.format("{session}").replace("demo", "{agent}")
    line = f'jetloop_gateway_requests_total{{method="POST",route="{route}",status="{status}"}}'
    for ln in text.decode().splitlines():
        if ln.startswith(line + " "):
            return float(ln.split()[-1])
    return 0.0


def test_a_cross_origin_text_plain_post_is_refused(gateway: str) -> None:
    """A `text/plain` POST carrying another page's Origin (what `fetch(…, {mode: "no-cors"})`
    sends without a preflight) is 403, problem+json naming the origin; no session starts.
    The same with `Sec-Fetch-Site: cross-site` and no Origin, and an approval likewise."""
    body = json.dumps({"text": "list tickets"}).encode()
    plain = {"Content-Type": "text/plain;charset=UTF-8"}
    status, got = call(
        gateway, "POST", MESSAGES.format("xo"), body, {**plain, "Origin": "http://127.0.0.1:1"}
    )
    assert status == 403, got
    assert got["title"] == "cross-origin request" and "http://127.0.0.1:1" in got["detail"]
    # JSON from another origin is refused all the same (a preflight would not be answered).
    status, _ = call(
        gateway, "POST", MESSAGES.format("xo"), body, {**JSON, "Origin": "https://evil.example"}
    )
    assert status == 403
    status, _ = call(
        gateway, "POST", MESSAGES.format("xo"), body, {**plain, "Sec-Fetch-Site": "same-site"}
    )
    assert status == 403
    decision = json.dumps({"approve": True}).encode()
    status, _ = call(
        gateway, "POST", "/v1/sessions/xo/approvals/a1", decision, {**plain, "Origin": "null"}
    )
    assert status == 403
    # Another page cannot read the data routes either.
    status, _ = call(gateway, "GET", "/v1/sessions", None, {"Origin": "http://localhost:1"})
    assert status == 403
    assert no_session(gateway, "xo")


def test_a_foreign_host_is_refused(gateway: str) -> None:
    """A request naming another Host (a rebinding page names its own), even a well-formed
    JSON POST from "its own" origin, is 421; so is a loopback name with another port. The
    loopback names with the gateway's port are served."""
    port = gateway.rsplit(":", 1)[1]
    body = json.dumps({"text": "list tickets"}).encode()
    for host in (f"rebind.example:{port}", "127.0.0.1:1", f"evil@127.0.0.1:{port}"):
        origin = {"Origin": f"http://{host}"}
        status, got = call(
            gateway, "POST", MESSAGES.format("rb"), body, {**JSON, **origin, "Host": host}
        )
        assert status == 421, (host, got)
        assert got["title"] == "not this gateway's host"
    status, got = call(gateway, "GET", "/", None, {"Host": f"rebind.example:{port}"})
    assert status == 421
    assert no_session(gateway, "rb")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
        assert call(gateway, "GET", "/v1/whoami", None, {"Host": host})[0] == 200


def test_a_write_must_be_json(gateway: str) -> None:
    """Without any Origin (not a browser, or an old one), a write whose body is not
    `application/json` is 415: a text/plain or form body, or a body without a type."""
    body = json.dumps({"text": "list tickets"}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": ctype} if ctype else {}
        status, got = call(gateway, "POST", MESSAGES.format("ct"), body, headers)
        assert status == 415, (ctype, got)
        assert got["title"] == "JSON required"
    assert no_session(gateway, "ct")


def test_json_from_the_gateways_own_origin_runs_a_turn(gateway: str) -> None:
    """The request the console sends: JSON, its own Origin, `Sec-Fetch-Site: same-origin`.
    It runs a turn to the end; a JSON POST without Origin (curl) does too, and a signed
    route (a webhook) is judged by its signature, whatever its Host and type."""
    body = json.dumps({"text": "list tickets"}).encode()
    own = {**JSON, "Origin": gateway, "Sec-Fetch-Site": "same-origin"}
    path = MESSAGES.format("same") + "?wait=true&timeout=30"
    status, got = call(gateway, "POST", path, body, own)
    assert (status, got["status"]) == (200, "completed"), got
    status, got = call(gateway, "POST", MESSAGES.format("curl") + "?wait=true", body, JSON)
    assert (status, got["status"]) == (200, "completed"), got
    status, got = call(
        gateway, "POST", "/v1/hooks/nope", b"x", {"Content-Type": "text/plain", "Host": "tunnel"}
    )
    assert (status, got["title"]) == (404, "no such trigger"), got


# --- in a browser ----------------------------------------------------------------------


ATTACK = """<!doctype html>
<title>waiting</title>
<iframe name="sink"></iframe>
<form id="form" method="POST" target="sink" enctype="text/plain" action="{gw}{form}">
  <input name='{{"text": "list tickets' value='"}}'>
</form>
<script>
(async () => {{
  await fetch("{gw}{fetch}", {{method: "POST", mode: "no-cors",
    headers: {{"Content-Type": "text/plain"}}, body: JSON.stringify({{text: "list tickets"}})}});
  document.querySelector("iframe").onload = () => {{ document.title = "sent"; }};
  document.getElementById("form").submit();
}})();
</script>
"""


@pytest.fixture
def attacker(gateway: str) -> Iterator[str]:
    """A second HTTP server on another port (another origin): the attack page's URL."""
    page = ATTACK.format(
        gw=gateway, fetch=MESSAGES.format("web-fetch"), form=MESSAGES.format("web-form")
    ).encode()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/attack.html"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def browser() -> Iterator[Browser]:
    """Chromium with a fresh profile, resolving ``rebind.test`` to 127.0.0.1 (as a rebinding
    DNS server would, once the page has loaded)."""
    assert sync_playwright is not None
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--host-resolver-rules=MAP rebind.test 127.0.0.1",
            ],
        )
        try:
            yield b
        finally:
            b.close()


@needs_browser
def test_a_page_of_another_origin_starts_no_turn(
    gateway: str, attacker: str, browser: Browser
) -> None:
    """A page on another port posts a `text/plain` no-cors fetch and a text/plain form whose
    body is JSON: the gateway answers both 403 and no session exists; a page whose name
    resolves to 127.0.0.1 posts JSON to "its own origin": 421, no session. The console,
    served by the gateway, still sends a message and approves the held call."""
    before = {status: sends_answered(gateway, status) for status in (202, 403)}
    page = browser.new_page()
    page.goto(attacker)
    page.wait_for_function("document.title === 'sent'", timeout=WAIT_MS)
    assert sends_answered(gateway, 202) == before[202]  # without the rules: + 2, two turns
    assert sends_answered(gateway, 403) == before[403] + 2
    assert no_session(gateway, "web-fetch") and no_session(gateway, "web-form")

    port = gateway.rsplit(":", 1)[1]
    page.goto(f"http://rebind.test:{port}/healthz")
    status = page.evaluate(
        """async (path) => (await fetch(path, {method: "POST",
             headers: {"Content-Type": "application/json"},
             body: JSON.stringify({text: "list tickets"})})).status""",
        MESSAGES.format("web-rebind"),
    )
    assert status == 421
    assert no_session(gateway, "web-rebind")

    console = browser.new_page(viewport={"width": 1280, "height": 900})
    console.goto(gateway + "/#/chat?session=web-held&agent=demo")
    expect(console.locator("#whoami")).to_contain_text("anonymous", timeout=WAIT_MS)
    console.locator("#chat-text").fill("close T-1")
    console.locator("#chat-send").click()
    expect(console.locator("#chat-log")).to_contain_text("waits for approval", timeout=WAIT_MS)
    console.goto(gateway + "/#/inbox")
    item = console.locator('#inbox [data-kind="approval"][data-session="web-held"]')
    expect(item).to_be_visible(timeout=WAIT_MS)
    item.locator("button.approve").click()
    expect(item).to_have_count(0, timeout=WAIT_MS)
