"""`jetloop up` left running, as a person leaves it: it stays up.

Turns come in bursts (one every few seconds, half through the NATS client and half through
the gateway) with idle gaps of 20+ s between them; at the end up is alive, every turn was
answered, no component failed, and the memory of its process tree (python and nats-server,
read from /proc) has not grown past a bound.

The soak itself is ``tests/soak.py``. It runs in a process of its own, started when the
suite collects this test (tests/conftest.py), beside every other test, for at least
``JETLOOP_UP_SOAK_SECONDS`` (default 180) and on until this test runs: in a whole-suite run
it lasts the suite (20-odd minutes, dozens of idle gaps) and costs it no time. Marked
``slow``. For a long run on its own: ``JETLOOP_UP_SOAK_SECONDS=900 .venv/bin/pytest -m slow
tests/test_up_soak.py``.

Memory, from measurements here (2 cores, the demo agent). The tree (python + nats-server)
starts at ~89 MB after the first burst and grows with the turns, by design: each worker keeps
the history of up to 512 sessions (``jetloop.streams.history``) and up to 4,096 verified
records decoded (``jetloop.streams.state``), and nats-server the streams'
per-subject state and its caches. In a whole-suite run (19 min, 140 turns on four sessions)
that was +41 MB, ~0.3 MB a turn, of which Python's heap +16 MB and nats-server's +21 MB.

Idle, our Python does not grow: sampled every second through that run, its heap (RssAnon)
moved only while turns ran. nats-server's resident set does move while idle, by up to ±4 MB
in one gap (+0.5 MB a second for 15 s, then −4.5 MB at once): its Go collector lets the
garbage of the idle pull requests pile up to twice the live heap before it collects, so a
gap that sums the server's growth measures when its collector ran. The summed idle growth of
the tree went over 4 MB in two whole-suite runs that way (6.0 and 11.0 MB), with no leak.

So the bounds: the idle gaps together (each measured from its fourth second, when the last
turn of the burst has been projected) grow our Python processes' heap by at most 4 MB (an idle
leak of a few KB a fetch, ~5 fetches a second, fails a 180 s run); and over the run the whole
tree, server included, grows by at most 10 MB plus 0.4 MB a turn past the first burst (above
what was measured, and a leak in the server's state that we cause, a consumer or a subject
per fetch, still shows there).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from secrets import token_hex

import pytest

from jetloop.services.embedded import die_with_parent
from tests.soak import BURST
from tests.test_up import alive

SECONDS = float(os.environ.get("JETLOOP_UP_SOAK_SECONDS", "180"))
IDLE_GROWTH_MB = 4.0  # our Python processes' heap, all idle gaps together
BASE_GROWTH_MB = 10.0  # over the run, past the first burst ...
PER_TURN_MB = 0.4  # ... plus this per turn after it
NODE_ID = "tests/test_up_soak.py::test_up_stays_up_with_bursts_and_idle_gaps"


# The directory of this run's soak, named by the process that runs the tests or, with
# pytest-xdist, hands them out (tests/conftest.py), for its test processes to find it.
DIR_ENV = "JETLOOP_TESTS_UP_SOAK_DIR"


def name_the_soak_dir() -> None:
    os.environ[DIR_ENV] = str(Path(tempfile.gettempdir()) / f"jetloop-up-soak-{token_hex(6)}")


def soak_dir() -> Path:
    return Path(os.environ[DIR_ENV])


class Soak:
    """The soak's process (``python -m tests.soak``) and its directory (``directory``, made
    here; a new temporary one without it)."""

    def __init__(self, directory: Path | None = None) -> None:
        if directory is None:
            directory = Path(tempfile.mkdtemp(prefix="jetloop-up-soak-"))
        else:
            directory.mkdir(mode=0o700)
        self.dir = directory
        self.log = open(self.dir / "soak.log", "wb")  # open while it runs
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.soak", str(self.dir), str(SECONDS)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).parent.parent,
            preexec_fn=die_with_parent(),  # and its `up` dies with it
        )

    def finish(self, timeout: float) -> dict[str, object]:
        """Ask it to stop (it has run at least SECONDS by then) and read what it saw."""
        (self.dir / "stop").touch()
        try:
            self.proc.wait(timeout)
        finally:
            self.close()
        result = self.dir / "result.json"
        assert result.exists(), (self.dir / "soak.log").read_text()[-3000:]
        out: dict[str, object] = json.loads(result.read_text())
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def finish_elsewhere(directory: Path, timeout: float) -> dict[str, object]:
    """``Soak.finish`` for a soak another process of the run started and owns (pytest-xdist's
    process that hands out the tests; it stops the process at the end of the run): asked to
    stop through its file, what it saw read once it has written it."""
    (directory / "stop").touch()
    result = directory / "result.json"  # written whole (renamed into place) as it ends
    deadline = time.monotonic() + timeout
    while not result.exists():
        assert time.monotonic() < deadline, (directory / "soak.log").read_text()[-3000:]
        time.sleep(0.5)
    out: dict[str, object] = json.loads(result.read_text())
    return out


# Started by tests/conftest.py when this test is collected.
running: list[Soak] = []


@pytest.mark.slow
@pytest.mark.timeout(SECONDS + 240)
def test_up_stays_up_with_bursts_and_idle_gaps() -> None:
    """Up answers every turn of bursts separated by idle gaps, for the whole run; nothing
    fails, nothing leaks, and Ctrl-C still stops it cleanly."""
    started = time.monotonic()
    if running:  # started by this process
        directory = running[-1].dir
        r = running.pop().finish(timeout=SECONDS + 180)
    elif soak_dir().exists():  # started by the process that hands out the tests
        directory = soak_dir()
        r = finish_elsewhere(directory, timeout=SECONDS + 180)
    else:
        soak = Soak()
        directory = soak.dir
        r = soak.finish(timeout=SECONDS + 180)
    print(f"waited {time.monotonic() - started:.0f} s for the soak; it ran {r['seconds']:.0f} s")
    up_log = (directory / "up.log").read_text()[-3000:]
    assert r["failure"] == "", (r["failure"], up_log)
    assert r["alive_at_end"], up_log
    # Per gap: turns so far, (tree, python heap, server) MB before it and after it.
    samples = [(n, *before, *after) for n, before, after in r["samples"]]  # type: ignore[attr-defined]
    turns = r["turns"]
    assert isinstance(turns, int)
    print("turns; tree, python heap, server MB before and after each idle gap:", samples)
    assert r["answered"] == turns and turns >= BURST * 2
    assert r["component_failed"] == [], r["component_failed"]
    idle_growth = sum(
        max(0.0, py_after - py_before) for _, _, py_before, _, _, py_after, _ in samples
    )
    assert idle_growth <= IDLE_GROWTH_MB, (idle_growth, samples)
    first_turns, first = samples[0][0], samples[0][1]
    growth = max(s[4] for s in samples) - first
    allowed = BASE_GROWTH_MB + PER_TURN_MB * (turns - first_turns)
    assert growth <= allowed, (growth, allowed, samples)
    assert r["exit_code"] == 0, up_log  # Ctrl-C stopped it cleanly ...
    assert not alive(int(r["server_pid"])), "nats-server outlived up"  # type: ignore[call-overload]
    shutil.rmtree(directory, ignore_errors=True)
