"""The peer benchmark's plumbing without its peers: a peer that is not installed is named,
with what to install, instead of failing the run; the tables show each system and jetloop's
ratio to each peer. (The peers themselves, Restate and DBOS, are optional installs that CI
does not have; ``jetloop bench peer`` runs them.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jetloop.tooling.bench.peer import (
    DBOS,
    JETLOOP,
    RESTATE,
    PeerResult,
    PeerRow,
    SystemRun,
    available,
)
from jetloop.tooling.bench.peer import format_peer as render
from jetloop.tooling.bench.report import BenchReport, judge
from jetloop.tooling.bench.restate import side as restate_side
from jetloop.tooling.bench.rig import Latency


def test_restate_missing_is_said_with_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no restate-server binary, Restate is left out and the sentence says how to
    install it; the other peers are unaffected."""
    monkeypatch.setenv(restate_side.SERVER_ENV, "/nonexistent/restate-server")
    peers, skipped = available()
    assert RESTATE not in peers
    said = next(s for s in skipped if s.startswith("Restate skipped"))
    assert "restate-server binary" in said
    assert "npm ci --prefix jetloop/tooling/bench/restate" in said
    assert "pip install -e '.[peer]'" in said


def _run(p50: float, p99: float, steps: float) -> SystemRun:
    return SystemRun(Latency(n=10, p50_ms=p50, p99_ms=p99, mean_ms=p50), steps)


def _result() -> PeerResult:
    rows = [
        PeerRow(
            "sequential",
            10,
            1,
            {
                JETLOOP: _run(20.0, 30.0, 300.0),
                RESTATE: _run(10.0, 20.0, 600.0),
                DBOS: _run(40.0, 60.0, 150.0),
            },
        ),
        PeerRow(
            "50 in flight",
            10,
            50,
            {
                JETLOOP: _run(500.0, 700.0, 480.0),
                RESTATE: _run(250.0, 350.0, 1200.0),
                DBOS: _run(1000.0, 1400.0, 240.0),
            },
        ),
    ]
    return PeerResult(
        rows=rows,
        peers=[RESTATE, DBOS],
        versions={RESTATE: "Restate 1.7.12", DBOS: "DBOS Transact 3.4.0 (SQLite)"},
        skipped=[],
        dbos={
            "checkpoints_per_turn": 7.0,
            "journal_mode": "delete",
            "synchronous": "FULL",
            "sqlite_bytes": 600_000,
        },
        restate_journal_per_turn={"Command: Run": 7.0},
        load_before=(0.5, 0.4, 0.3),
        load_after=(1.5, 0.9, 0.5),
        cores=2,
        chunks=4,
    )


def test_tables_show_each_system_and_the_ratios() -> None:
    """One row per system, then jetloop ÷ each peer; the load average is printed."""
    text = render(_result())
    assert "| **jetloop** | 20.0 | 30.0 | 300 | 500.0 | 700.0 | 480 | 10+10 |" in text
    assert "| Restate | 2.00× | 1.50× | 0.50× | 2.00× | 2.00× | 0.40× |" in text
    assert "| DBOS | 0.50× | 0.50× | 2.00× | 0.50× | 0.50× | 2.00× |" in text
    assert "0.50 / 0.40 / 0.30 at the start" in text


def test_the_report_says_how_many_steps_a_worker_ran_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pools' sizes decide throughput at width: the notes give them, as the workers'
    settings resolve in the bench's environment (which its workers inherit)."""
    from dataclasses import replace

    from jetloop.tooling.bench.peer import worker_pools

    monkeypatch.delenv("JETLOOP_MODEL_CONCURRENCY", raising=False)
    monkeypatch.setenv("JETLOOP_TOOL_CONCURRENCY", "5")
    monkeypatch.delenv("JETLOOP_SESSION_CONCURRENCY", raising=False)
    assert worker_pools() == (64, 5, 32)
    text = render(replace(_result(), pools=worker_pools()))
    assert "through one worker (a worker runs at once up to 64 model, 5 tool and 32" in text


def test_the_restate_target_is_judged() -> None:
    """Issue 15's bar against Restate: steps/s at width, p50 and p99 sequential."""
    rep = BenchReport(machine={}, peer=_result())
    (target,) = judge(rep)
    assert "0.40× steps/s" in target.measured
    assert not target.met


def test_jetloop_on_several_workers_is_named_in_the_table_and_the_target() -> None:
    """``jetloop bench peer --workers 2``: the row, the notes and the verdict say so."""
    from dataclasses import replace

    result = replace(_result(), workers=2)
    text = render(result)
    assert "| **jetloop**, 2 workers | 20.0 |" in text
    assert "through 2 worker processes (a worker runs at once up to" in text
    (target,) = judge(BenchReport(machine={}, peer=result))
    assert target.measured.endswith("; jetloop on 2 workers")


def test_what_a_turn_costs_is_counted_and_shown() -> None:
    """Messages and CPU per turn: a batch's cost is the difference of two readings over its
    turns; CPU time comes from /proc (this process has spent some); the table shows each
    metered system per load, and `n/a` where a process's CPU could not be read."""
    import os

    from jetloop.tooling.bench.costs import Cost, Reading, cpu_seconds

    assert (cpu_seconds(os.getpid()) or 0.0) > 0.0
    assert cpu_seconds(2**22 + 12345) is None  # no such process
    cost = Cost()
    cost.add(Reading(100, 200, 1.0, 2.0, 0.5), Reading(800, 1400, 1.05, 2.1, 0.51), 10)
    per = cost.per_turn()
    assert per["in_msgs"] == 70 and per["out_msgs"] == 120
    assert (
        round(per["server_cpu_ms"] or 0, 3) == 5.0 and round(per["worker_cpu_ms"] or 0, 3) == 10.0
    )
    unread = Cost()
    unread.add(Reading(0, 0, None, 1.0, 0.0), Reading(7, 9, None, 1.5, 0.0), 1)
    assert unread.per_turn()["server_cpu_ms"] is None

    result = _result()
    result.costs = {"50 in flight": {JETLOOP: per, "floor": unread.per_turn()}}
    text = render(result)
    assert "| jetloop, 50 in flight | 70.0 | 120.0 | 5.0 | 10.0 | 1.0 |" in text
    assert "| floor, 50 in flight | 7.0 | 9.0 | n/a | 500.0 | 0.0 |" in text


def test_lever_1s_floor_is_shown_against_restate() -> None:
    """`jetloop bench peer --lever1`: the floor of lever 1's write pattern has its row and a
    table of its own against Restate (what the change could reach, measured in the run)."""
    from jetloop.tooling.bench.peer import FLOOR1

    result = _result()
    for row, run in zip(
        result.rows, (_run(5.0, 10.0, 900.0), _run(100.0, 140.0, 2400.0)), strict=True
    ):
        row.systems[FLOOR1] = run
    text = render(result)
    assert "| floor, lever 1 | 5.0 | 10.0 | 900 |" in text
    assert "| floor, lever 1 ÷ | sequential p50 |" in text
    assert "| Restate | 0.50× | 0.50× | 1.50× | 0.40× | 0.40× | 2.00× |" in text


async def test_the_rig_beside_a_jetloop_up_store_uses_its_own_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from a directory where `jetloop up` left its store (the README's first look does),
    the bench's workers connect with the rig's credentials, not the store's: a turn runs."""
    from jetloop.tooling.bench.rig import Rig

    store = tmp_path / "cwd" / ".jetloop"
    store.mkdir(parents=True)
    (store / "nats-users.json").write_text('{"worker": "not-this-servers-password"}')
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.delenv("JETLOOP_STORE_DIR", raising=False)
    r = Rig(tmp_path / "rig")
    await r.start()
    try:
        await r.start_workers(1)
        ended = await r.engine_turn("s1", "r1", 2)
        await asyncio.wait_for(ended, 30)
    finally:
        await r.close()
