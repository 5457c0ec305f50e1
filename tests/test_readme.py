"""The Python blocks of the user's documents (the README and the guides it leads to) run, so
they cannot rot.

Each ```python block of :data:`USER_DOCS` is either a file (its first line is ``# <name>.py``) or
marked ``<!-- snippet: not run (why) -->`` on the line before it. The files are written to
a directory: ``myapp.py`` is served by a real worker, ``client.py`` is run against it as a
user would run it (``python client.py``). The blocks not run must at least parse.
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

from jetloop.schemas import TurnStatus
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer
from tests.conftest import WorkerFactory

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
NOT_RUN = re.compile(r"<!-- snippet: not run \(.+\) -->\n$")
FILE = re.compile(r"^# ([a-z_]+\.py)\n")
# What a user follows: the README and the guides in docs/ it leads to, in reading order.
USER_DOCS = [
    ROOT / "README.md",
    *(ROOT / "docs" / f"{name}.md" for name in ("tour", "agents", "crash-testing", "operating")),
    ROOT / "docs" / "testing.md",
]


def user_docs() -> str:
    """The user's documents as one text, in reading order."""
    return "\n".join(p.read_text() for p in USER_DOCS)


def blocks() -> tuple[dict[str, str], list[str]]:
    """The user documents' files by name, and the blocks marked not run."""
    text = user_docs()
    files: dict[str, str] = {}
    skipped: list[str] = []
    for m in BLOCK.finditer(text):
        code = m.group(1)
        named = FILE.match(code)
        if NOT_RUN.search(text[: m.start()]):
            skipped.append(code)
        else:
            assert named, (
                f"a python block of the user docs is neither a file nor marked not run:\n{code}"
            )
            files[named.group(1)] = code
    return files, skipped


def test_blocks_not_run_still_parse() -> None:
    """A fragment that is not run still has to be Python (top-level await allowed)."""
    _, skipped = blocks()
    assert skipped
    for code in skipped:
        compile(code, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT | ast.PyCF_ONLY_AST)


async def test_readme_app_and_client_run(
    tmp_path: Path, nats_ready: EmbeddedServer, workers: WorkerFactory
) -> None:
    """The README's own app, served by a worker, answers the README's client program, which
    prints what the README says it prints and nothing on stderr; "one turn's events" are that
    turn's alone, though the session had a turn before."""
    files, _ = blocks()
    # shop.py and test_shop.py, the crash test's example, and bank.py, the MCP example, are
    # run by tests/test_crashtest.py.
    assert set(files) == {"myapp.py", "client.py", "shop.py", "test_shop.py", "bank.py"}, sorted(
        files
    )
    for name in ("myapp.py", "client.py"):
        (tmp_path / name).write_text(files[name])
    path = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    w = workers.start(app="myapp:app", env={"PYTHONPATH": path})
    await w.wait_for("worker.started", timeout=30)
    async with await Client.connect(nats_ready.url) as c:
        earlier = await c.send("support", "c1", "refund order 42", request_id="earlier")
        assert (await c.wait(earlier, timeout=60)).status == TurnStatus.COMPLETED
    env = {**os.environ, "JETLOOP_NATS_URL": nats_ready.url, "PYTHONPATH": path}
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "client.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "done: {'order': '42', 'refunded': 500}", out.stdout
    assert any(" order-42 completed 1 call(s)" in ln for ln in lines), out.stdout
    assert any(ln.endswith("refund succeeded {'order': '42', 'refunded': 500}") for ln in lines)
    assert lines[-1] == "refund succeeded", out.stdout
    assert lines.count("refund succeeded") == 1, out.stdout


def test_the_readme_is_one_screen_that_leads_to_every_guide() -> None:
    """The README is the set-up and a first look (a screen or so, not a manual); every guide
    the rest lives in is linked from it, so a reader finds each."""
    readme = USER_DOCS[0].read_text()
    assert len(readme.splitlines()) <= 100, "the README grew past a quickstart: move it to docs/"
    for guide in USER_DOCS[1:]:
        assert f"](docs/{guide.name})" in readme, f"the README does not lead to docs/{guide.name}"
