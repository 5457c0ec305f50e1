"""What a person following the README meets: the test suite beside a store of `jetloop up`, a
model failure that says why, `jetloop turn`'s answer, hints they can paste, a failed `up`
that leaves nothing behind, and a CLI that starts at once."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import click
import pytest

from jetloop.consumers.run_model import _cause
from jetloop.schemas.errors import TurnFailed
from jetloop.services.cli import main
from jetloop.services.cli.main import COMMANDS, FIRST_CONNECT, _with_client, load_commands
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer, free_port
from jetloop.services.settings import load_settings
from tests.conftest import STORE, WorkerFactory, body, script
from tests.test_up import wait_ready

ROOT = Path(__file__).resolve().parent.parent
# The console script, as the README runs it (`.venv/bin/jetloop`).
SCRIPT = Path(sys.executable).with_name("jetloop")
# What a subprocess may take beyond the command's own bound: Python's start on a busy box.
SLACK = 5.0


async def test_a_client_in_the_tests_uses_the_runs_own_settings(
    client: Client, workers: WorkerFactory
) -> None:
    """Inside the test run no setting of the caller's applies: the store directory is the
    run's own, no NATS user is set, and a worker the test starts serves a turn."""
    assert load_settings().store_dir == STORE != Path(".jetloop")
    assert "JETLOOP_NATS_USER" not in os.environ
    workers.start()
    h = await client.send("tester", "own-settings", script(answer="fine"))
    assert body((await client.wait(h, timeout=60)).text)["messages"]


def test_the_suite_passes_beside_a_store_of_up(tmp_path: Path) -> None:
    """Run where `jetloop up` ran (a `.jetloop` with its NATS passwords and seal key) and
    with the user's own NATS settings in the environment, the tests still pass: they read
    neither (before: 104 errors, every test connecting with `up`'s password)."""
    store = tmp_path / ".jetloop"
    store.mkdir()
    (store / "nats-users.json").write_text('{"worker": "not-this-server", "watch": "nor-this"}')
    (store / "seal.key").write_text("")  # unreadable as a key: fails any process that reads it
    env = {
        **os.environ,
        "JETLOOP_NATS_USER": "someone",
        "JETLOOP_NATS_PASSWORD": "theirs",
        "JETLOOP_SEAL_KEY": "",
    }
    env.pop("JETLOOP_STORE_DIR")
    test = "test_a_client_in_the_tests_uses_the_runs_own_settings"
    node = f"{ROOT / 'tests' / 'test_user_path.py'}::{test}"
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "1 passed" in ran.stdout, ran.stdout


async def test_a_model_that_cannot_be_reached_fails_the_turn_with_the_cause(
    client: Client, workers: WorkerFactory
) -> None:
    """A model step that failed on every attempt fails its turn with an error naming the last
    attempt's cause (a connection failure to the provider's host), where `send`, the snapshot,
    the gateway and the console read it, not only the worker's log."""
    port = free_port()  # nothing listens here
    workers.start(
        app="jetloop.demo.agent:app",
        env={
            "JETLOOP_MODEL": "openai:gpt-test",
            "JETLOOP_MODEL_API_KEY": "sk-test",
            "JETLOOP_MODEL_BASE_URL": f"http://127.0.0.1:{port}/v1",
        },
    )
    h = await client.send("demo", "unreachable", "hello")
    with pytest.raises(TurnFailed) as failed:
        await client.wait(h, timeout=60)
    error = failed.value.turn.error
    assert error is not None
    assert error.startswith("model step 0 failed after 3 attempts: openai: "), error
    assert "connection failed" in error and f"127.0.0.1:{port}" in error, error
    page = await client.turns("unreachable")
    assert [t.error for t in page.turns] == [error]


def test_an_sdk_error_is_told_with_its_types_chain_and_url() -> None:
    """An error from a model SDK (not a jetloop provider error) is told with each error of its
    chain and the URL its request went to, without the query."""

    class Request:
        url = "http://127.0.0.1:9/v1/chat/completions?key=secret"

    class ConnectError(Exception):
        request = Request()

    class APIConnectionError(Exception):
        pass

    try:
        try:
            raise ConnectError("All connection attempts failed")
        except ConnectError as inner:
            raise APIConnectionError("Connection error.") from inner
    except APIConnectionError as exc:
        told = _cause(exc)
    assert told == (
        "APIConnectionError: Connection error. ← ConnectError: All connection attempts failed "
        "(http://127.0.0.1:9/v1/chat/completions)"
    )


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=60, cwd=cwd)


async def test_turn_prints_the_answer(
    nats_ready: EmbeddedServer, client: Client, workers: WorkerFactory
) -> None:
    """`jetloop turn` shows the turn's answer, as its help says, after its calls."""
    workers.start()
    h = await client.send("tester", "answered", script(answer="the answer is 42"))
    res = await client.wait(h, timeout=60)
    out = await asyncio.to_thread(cli, "turn", "answered", h.turn_id, "--nats", nats_ready.url)
    assert out.returncode == 0, out.stderr
    assert res.text is not None and out.stdout.rstrip().endswith(res.text), out.stdout
    assert "the answer is 42" in out.stdout


def test_up_hints_the_command_as_run_and_removes_its_lock(tmp_path: Path) -> None:
    """`up` started by its path hints `<that path> chat`; a second `up` on its store fails and
    leaves the first one's lock; when `up` ends, `up.lock` is gone; an `up` that cannot start
    (an app that does not load) leaves no `up.lock` behind."""
    store = tmp_path / "store"
    log = tmp_path / "up.log"
    env = {**os.environ, "JETLOOP_VENDOR_DB": str(tmp_path / "vendor.sqlite")}
    env.pop("JETLOOP_STORE_DIR")
    up = [str(SCRIPT), "up", "--store-dir", str(store), "--gateway-port", "0"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [*up, "--nats-port", str(free_port())],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        wait_ready(proc, log)
        # Another store than the one in this directory: the hint says which.
        hint = f"try: JETLOOP_STORE_DIR={store} {SCRIPT} chat --agent demo"
        assert hint in log.read_text(), log.read_text()
        second = subprocess.run(
            [*up, "--nats-port", str(free_port())],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 1 and "another `jetloop up`" in second.stderr, second
        assert (store / "up.lock").read_text().strip() == str(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not (store / "up.lock").exists()

    failed = subprocess.run(
        [*up, "--nats-port", str(free_port()), "--app", "no_such_module:app"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert failed.returncode == 1 and "JETLOOP_APP" in failed.stderr, failed
    assert store.is_dir() and not (store / "up.lock").exists()


def test_version_imports_nothing_heavy() -> None:
    """`jetloop --version` imports neither the engine nor NATS, HTTP or pydantic: the CLI
    loads a command's module only when that command runs (before: about 1 s of imports)."""
    code = (
        "import sys\n"
        "from jetloop.services.cli import main\n"
        "try:\n"
        "    main(['--version'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('nats', 'aiohttp', 'pydantic', 'jetloop.consumers', 'jetloop.agents',\n"
        "         'jetloop.services.client', 'jetloop._face')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.splitlines()[-1] == "[]", out.stdout
    best = min(_timed(str(SCRIPT), "--version") for _ in range(3))
    assert best < 0.3 + SLACK, best  # on an idle machine: about 0.1 s


def _timed(*args: str) -> float:
    t0 = time.monotonic()
    subprocess.run(args, capture_output=True, check=True, timeout=60)
    return time.monotonic() - t0


def test_every_command_is_in_the_table_of_its_module() -> None:
    """The lazy command table names every command with the module that defines it, and
    nothing else: a command missing from it would cost every other command its imports."""
    load_commands()
    assert set(main.commands) == set(COMMANDS)
    for name, module in COMMANDS.items():
        callback = main.commands[name].callback
        assert callback is not None
        # gateway and projector come from their own packages; `run` adds them to the group.
        assert callback.__module__.endswith(f".{module}") or module == "run", name


async def test_a_command_without_nats_says_so_at_once() -> None:
    """With nothing listening, a client command fails its first connect within about
    FIRST_CONNECT (before: the five seconds it waits out an outage)."""
    url = f"nats://127.0.0.1:{free_port()}"

    async def never(jl: Client) -> None:
        raise AssertionError("connected to nothing")

    t0 = time.monotonic()
    with pytest.raises(click.ClickException) as told:
        await _with_client([url], never, None)
    assert time.monotonic() - t0 < FIRST_CONNECT + 1.0
    assert str(told.value.message) == f"cannot reach NATS at {url} (is 'jetloop up' running?)"


def test_commands_in_ups_directory_find_it_on_the_ports_it_was_given(tmp_path: Path) -> None:
    """`up --nats-port P --gateway-port G` in a directory: the commands run there with no URL
    of their own (as its hint says) reach that server, not 4222: send, snapshot, sessions. A
    namespace made there is served once `namespace create` returns; `--namespace` reads that
    namespace's sessions (the read-model commands too), and the loopback console without a
    token opens it. When `up` ends its address file is gone."""
    nats_port, gateway_port = free_port(), free_port()
    env = {**os.environ, "JETLOOP_VENDOR_DB": str(tmp_path / "vendor.sqlite")}
    env.pop("JETLOOP_STORE_DIR")
    log = tmp_path / "up.log"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
        )

    def eventually(what: str, *args: str) -> str:
        deadline = time.monotonic() + 30
        while True:
            out = run(*args)
            if out.returncode == 0 and what in out.stdout:
                return out.stdout
            assert time.monotonic() < deadline, (args, out.stdout, out.stderr)
            time.sleep(0.3)

    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [str(SCRIPT), "up", "--nats-port", str(nats_port), "--gateway-port", str(gateway_port)],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        wait_ready(proc, log)
        assert f"hint='try: {SCRIPT} chat --agent demo'" in log.read_text(), log.read_text()
        sent = run("send", "--agent", "demo", "--session", "p1", "list tickets")
        assert sent.returncode == 0, sent.stderr
        snap = run("snapshot", "p1")
        assert snap.returncode == 0 and "p1" in snap.stdout, snap
        eventually("p1", "sessions")

        made = run("namespace", "create", "acme")
        assert made.returncode == 0, made.stderr
        assert "served by the running `jetloop up`" in made.stdout, made.stdout
        # At once, not seconds later: the namespace is served when create returns.
        sent = run("--namespace", "acme", "send", "--agent", "demo", "--session", "a1", "hi")
        assert sent.returncode == 0, sent.stderr
        acme = eventually("a1", "--namespace", "acme", "sessions")
        assert "p1" not in acme, acme
        assert "a1" not in run("sessions").stdout
        assert "a1" in eventually("a1", "sessions", "--namespace", "acme")

        async def console_reads_acme() -> None:
            url = f"http://127.0.0.1:{gateway_port}/v1/sessions?namespace=acme"
            async with aiohttp.ClientSession() as http, http.get(url) as resp:
                assert resp.status == 200, await resp.text()
                ids = [s["session_id"] for s in (await resp.json())["sessions"]]
                assert ids == ["a1"], ids

        asyncio.run(console_reads_acme())
        assert (tmp_path / ".jetloop" / "up.json").exists()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not (tmp_path / ".jetloop" / "up.json").exists()


def test_an_app_that_does_not_load_says_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A misspelt module is told apart from an error inside the user's module: the first
    says where it was looked for, the second gives the user's file and line (an import of a
    package that is not installed, a bug at import time, a syntax error), each one line."""
    from jetloop import AppLoadError
    from jetloop.agents import load_app

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AppLoadError, match=r"no module named 'no_such_bank' \(looked in "):
        load_app("no_such_bank:app")
    (tmp_path / "bank_imports.py").write_text("import os\nimport not_installed_pkg\napp = None\n")
    with pytest.raises(AppLoadError) as info:
        load_app("bank_imports:app")
    assert str(info.value) == (
        f"--app 'bank_imports:app': {tmp_path / 'bank_imports.py'}:2: "
        "ModuleNotFoundError: No module named 'not_installed_pkg'"
    )
    (tmp_path / "bank_bug.py").write_text(
        "x = 1\n\ndef make():\n    return {}['k']\n\napp = make()\n"
    )
    with pytest.raises(AppLoadError, match=r"bank_bug\.py:4: KeyError: 'k'$"):
        load_app("bank_bug:app")
    (tmp_path / "bank_syntax.py").write_text("app = (\n")
    with pytest.raises(AppLoadError, match=r"bank_syntax\.py:1: SyntaxError: "):
        load_app("bank_syntax:app")
    with pytest.raises(AppLoadError, match=r"module os has no 'nope'$"):
        load_app("os:nope")
    assert "\n" not in str(info.value)


def test_up_names_both_ports_when_both_are_taken(tmp_path: Path) -> None:
    """Both ports in use: one line naming both settings, not one per attempt."""
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        a.listen()
        b.bind(("127.0.0.1", 0))
        b.listen()
        nats_port, gateway_port = a.getsockname()[1], b.getsockname()[1]
        env = {**os.environ, "JETLOOP_STORE_DIR": str(tmp_path / "store")}
        ran = subprocess.run(
            [str(SCRIPT), "up", "--nats-port", str(nats_port), "--gateway-port", str(gateway_port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert ran.returncode == 1, ran
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"port {nats_port} of the embedded nats-server is in use" in lines[0], lines
    assert f"gateway port {gateway_port} on 127.0.0.1 is in use" in lines[0], lines


def test_the_demos_and_then_is_a_step_after_the_calls_before() -> None:
    """ "create ticket X and then list tickets": the list is asked for in a model step of its
    own, after the create's result is back (before: both at once, and the first answer
    showed `list_tickets: []` right after the create); ";" and "and" stay one step."""
    from jetloop.agents.model import Message, ModelRequest, ToolCallRequest
    from jetloop.demo.agent import script

    def asked(*messages: Message) -> list[str]:
        req = ModelRequest(
            agent="demo", instructions="", messages=list(messages), tools=[], attempt=1
        )
        return [c.name for c in script(req).tool_calls]

    user = Message(role="user", text="create ticket printer on fire and then list tickets")
    assert asked(user) == ["create_ticket"]
    create = ToolCallRequest("create_ticket", {"title": "printer on fire"})
    first = [
        user,
        Message(role="assistant", text="", calls=[create]),
        Message(role="tool", tool="create_ticket", status="ok", result={"id": "T-1"}),
    ]
    assert asked(*first) == ["list_tickets"]
    listing = ToolCallRequest("list_tickets", {})
    done = [
        *first,
        Message(role="assistant", text="", calls=[listing]),
        Message(role="tool", tool="list_tickets", status="ok", result=[{"id": "T-1"}]),
    ]
    assert asked(*done) == []
    both = Message(role="user", text="create ticket a; list tickets and look up T-1")
    assert asked(both) == ["create_ticket", "list_tickets", "get_ticket"]
