"""Kill trials at a reduced count: worker kills, server restarts, rolling deploys and upgrades
lose no turn and double no write, and take no claim from a live worker — also with busy
processes beside the workers.

Marked ``slow``; CI runs two rounds of each single-server mode (a deploy too), one round of a
rolling upgrade from the previous release, one round of each power-cut mode (and of its lazy
control), and one round of
a worker killed with the server while two busy processes load the machine
(``JETLOOP_TRIALS`` sets more, ``JETLOOP_KILL_SEED`` fixes the kill moments). The timing
targets (detection, completion) are reported by ``jetloop trials``, not asserted here: on a
shared CI machine they measure the machine.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from jetloop.services.natsauth import SYSTEM_ACCOUNT
from jetloop.services.settings import Settings
from jetloop.tooling.powercut.lazyfs import unavailable
from jetloop.tooling.trials.faults import NETWORK_FAULTS
from jetloop.tooling.trials.measures import (
    SeenEvent,
    abandoned_resumes,
    drained_resumes,
    engine_detection,
    false_takeovers,
    targets,
    worker_detection,
)
from jetloop.tooling.trials.netns import unavailable as netns_unavailable
from jetloop.tooling.trials.run import format_reports, percentile, run_trials
from jetloop.tooling.trials.servers import SingleServer, worker_env
from tests.test_upgrade import build_previous

FUSE = unavailable()
NETNS = netns_unavailable()
CONTROL_SEED = 5

ROUNDS = int(os.environ.get("JETLOOP_TRIALS", "2"))
SEED = int(os.environ.get("JETLOOP_KILL_SEED", str(random.randrange(1 << 30))))


def test_percentile_is_nearest_rank() -> None:
    """p50 and p99 are observed values (nearest rank), and nothing measured gives None."""
    assert percentile([], 99) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert percentile([1.0, 5.0], 99) == 5.0


def _resumed(turn: str, worker: str, at: float) -> SeenEvent:
    data = {"lost_worker": worker, "lost_incarnation": "i1", "step": f"s.{turn}.m0"}
    return SeenEvent("agent.run.crash_resumed", turn, at, at + 0.01, data)


def test_detection_is_the_first_resume_of_the_killed_worker() -> None:
    """After a worker kill, detection is the first resume naming it after the kill; resumes of
    others, or before the kill, do not count; no resume gives no value."""
    events = [
        _resumed("t1", "survivor", 100.5),
        _resumed("t1", "victim0", 99.0),
        _resumed("t2", "victim0", 102.0),
        _resumed("t1", "victim0", 101.5),
    ]
    assert worker_detection(events, "victim0", 100.0) == 1.5
    assert worker_detection(events, "victim1", 100.0) is None


def test_engine_detection_counts_events_made_after_the_kill_when_stored() -> None:
    """With no worker dead, detection is when the first event of a turn in flight made after
    the kill was stored; events of other turns, or made before the kill, do not count."""
    events = [
        SeenEvent("call.outcome", "t1", 99.9, 101.0, {}),  # made before, stored after
        SeenEvent("call.outcome", "t9", 100.1, 100.2, {}),  # not in flight
        SeenEvent("call.outcome", "t1", 100.3, 100.8, {}),
    ]
    assert engine_detection(events, {"t1"}, 100.0) == pytest.approx(0.8)
    assert engine_detection(events, {"t2"}, 100.0) is None


def test_false_takeovers_name_live_holders_once_per_loss() -> None:
    """A loss of a live worker is false (once per turn and incarnation, from the record or the
    event); the killed worker's loss is false only when resumed before the kill."""
    losses = {"t1": ["survivor/i1", "victim0/i1"], "t2": ["victim0/i1"]}
    events = [_resumed("t1", "survivor", 100.5), _resumed("t2", "victim0", 99.0)]
    found = false_takeovers(losses, events, {"survivor"}, "victim0", 100.0)
    assert found == [
        "t1 lost survivor/i1: survivor was alive",
        "t2 lost victim0/i1: resumed 1.00s before victim0 was killed",
    ]
    assert false_takeovers(losses, [], {"survivor", "victim0"}, None, 100.0) == [
        "t1 lost survivor/i1: survivor was alive",
        "t1 lost victim0/i1: victim0 was alive",
        "t2 lost victim0/i1: victim0 was alive",
    ]


def test_a_resume_of_a_step_its_live_holder_abandoned_is_not_false() -> None:
    """A resume the engine audited as abandoned (the live holder's delivery had ended
    unfinished) or drained is no false takeover, and is counted apart."""
    abandoned = _resumed("t1", "survivor", 100.5)
    abandoned.data["abandoned"] = True
    drained = _resumed("t2", "survivor", 100.6)
    drained.data["drained"] = True
    events = [abandoned, drained, _resumed("t3", "survivor", 100.7)]
    assert false_takeovers({}, events, {"survivor"}, None, 100.0) == [
        "t3 lost survivor/i1: survivor was alive"
    ]
    assert abandoned_resumes(events) == 1 and drained_resumes(events) == 1


def test_targets_follow_issues_14_and_31() -> None:
    """Worker kill: detection p99 ≤ 1 s (2 s with busy processes beside); a worker killed
    with the server: detection p99 ≤ restart p99 + lease + that slack; server restart:
    completion p99 ≤ restart p99 + 1 s; takeover: completion p99 ≤ election p99 + 1 s; and
    whatever failed, no false takeover."""
    row = {
        "detection_p99": 1.2,
        "completion_p99": 2.5,
        "restart_p99": 0.05,
        "election_p99": 1.6,
        "false_takeovers": 0,
    }
    kill = {t.measure: t.met for t in targets("worker_kill", row, 2.0)}
    assert kill == {"detection p99": False, "false takeovers": True}
    loaded = {t.measure: t.met for t in targets("worker_kill", row, 2.0, loaded=True)}
    assert loaded == {"detection p99": True, "false takeovers": True}
    both = {t.measure: t.limit for t in targets("worker_kill+server_restart", row, 2.0)}
    assert both == {"detection p99": pytest.approx(3.05), "false takeovers": 0.0}
    restart = {t.measure: (t.limit, t.met) for t in targets("server_restart", row, 2.0)}
    assert restart == {"completion p99": (1.05, False), "false takeovers": (0.0, True)}
    takeover = targets("takeover", row, 2.0)
    assert [(t.measure, t.limit, t.met) for t in takeover] == [
        ("completion p99", 2.6, True),
        ("false takeovers", 0.0, True),
    ]
    assert [t.measure for t in targets("node_restart", {**row, "false_takeovers": 1}, 2.0)] == [
        "false takeovers"
    ]
    assert not targets("node_restart", {**row, "false_takeovers": 1}, 2.0)[0].met


def _users(config: dict[str, object]) -> list[str]:
    accounts = config.get("accounts")
    assert isinstance(accounts, dict)
    return [u["user"] for a in accounts.values() for u in a.get("users", [])]


@pytest.mark.parametrize("system_account", [True, False])
def test_servers_without_the_system_account_give_workers_no_watch_user(
    system_account: bool, tmp_path: Path
) -> None:
    """``--no-system-account``: the servers' config names no system account and no ``watch``
    user, and a worker finds no watch password, neither in its environment nor in the store
    directory it is given; by default both are there."""
    server = SingleServer(tmp_path, system_account=system_account)
    config = json.loads((tmp_path / "nats-server.conf").read_text())
    env = worker_env(server)
    settings = Settings(nats_url=server.url, store_dir=Path(env["JETLOOP_STORE_DIR"]))
    if system_account:
        assert config["system_account"] == SYSTEM_ACCOUNT and "watch" in _users(config)
        assert env["JETLOOP_NATS_WATCH_PASSWORD"] == server.watch_password
        assert settings.nats_watch_urls is not None
        return
    assert "system_account" not in config and SYSTEM_ACCOUNT not in config["accounts"]
    assert "watch" not in _users(config)
    assert server.watch_password is None
    assert "JETLOOP_NATS_WATCH_PASSWORD" not in env
    assert settings.nats_watch_urls is None


@pytest.mark.timeout(150)
async def test_kill_trial_without_the_system_account(tmp_path: Path) -> None:
    """A worker-kill round on servers without the system account's watch user: no worker
    watches for disconnects, yet no turn is lost, no write doubled and no live worker's
    step taken; the report says the system account was off."""
    print(f"JETLOOP_KILL_SEED={SEED}")
    out = tmp_path / "report.json"
    run = tmp_path / "run"
    report = await run_trials("worker_kill", 1, SEED, out, work_dir=run, system_account=False)
    text = format_reports([report])
    print(text)
    assert not report.system_account and "system account off" in text
    assert report.lost == [], report.lost
    assert report.duplicates == [], report.duplicates
    assert report.false_takeovers == [], report.false_takeovers
    assert report.in_flight >= 1, "no turn was in flight at the kill"
    logs = sorted(run.glob("*.log"))
    assert {p.name for p in logs} >= {"survivor.log", "victim0.log"}
    for log in logs:
        assert "rescue.watching" not in log.read_text(), f"{log.name}: a worker watched"
    assert json.loads(out.read_text())["system_account"] is False


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("mode", "load", "rounds"),
    [
        ("worker_kill", 0, ROUNDS),
        ("server_restart", 0, ROUNDS),
        ("kill_and_restart", 0, ROUNDS),
        ("kill_and_restart", 2, 1),
        ("deploy", 0, ROUNDS),
        ("upgrade", 0, 1),
    ],
)
async def test_kill_trials(mode: str, load: int, rounds: int, tmp_path: Path) -> None:
    """Every turn caught by a kill ends, completed, no vendor write applies twice, and no live
    worker's claim is taken over; the report names the turns caught in flight and
    their detection and completion times, also as JSON."""
    print(f"JETLOOP_KILL_SEED={SEED}")
    if mode == "upgrade":
        build_previous(tmp_path / "run" / "releases")  # where the run looks for it
    out = tmp_path / "report.json"
    report = await run_trials(mode, rounds, SEED, out, work_dir=tmp_path / "run", load=load)
    print(format_reports([report]))
    assert report.load == load
    assert report.turns >= rounds
    assert report.lost == [], report.lost
    assert report.duplicates == [], report.duplicates
    assert report.stray_keys == [], "a write reached the vendor under a key no call owns"
    assert report.in_flight >= 1, "no turn was in flight at any kill"
    # No live worker's claim is taken over, after a worker kill or a server restart.
    assert report.false_takeovers == [], report.false_takeovers
    assert report.completion_p99 is not None and report.completion_max is not None
    # With no worker dead, a round with turns in flight sees the engine move again; after a
    # worker kill there is nothing to detect when the victim held no step.
    moved = [r for r in report.trials if r.failure == "server_restart" and r.in_flight]
    assert all(r.detection is not None for r in moved), [r.round for r in moved]
    saved = json.loads(out.read_text())
    assert saved["mode"] == mode and saved["rounds"] == rounds and saved["load"] == load
    assert len(saved["trials"]) == rounds
    assert {t["measure"] for t in saved["targets"]} >= {"false takeovers"}


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.skipif(FUSE is not None, reason=f"power cuts need FUSE: {FUSE}")
@pytest.mark.parametrize("mode", ["power_loss", "cluster_power_loss"])
async def test_power_cut_trials(mode: str, tmp_path: Path) -> None:
    """A power cut (every server's disk loses what it had not synced; on one server and in a
    cut of all three nodes, every worker dies with it) under turns in flight: with the
    default sync (``always``) no single-attempt write is made twice, no granted approval is
    asked again and no turn seen completed is gone, even though the client sends again every
    turn it heard no answer for; on one server also no turn is lost and no live worker's step
    is taken over. The control, the same round on nats-server's lazy default, shows the
    harm: the harness can fail.

    On the cluster a second round crashes one node (its disk cut) while another is cut off
    from its peers (where network namespaces can be made; else paused), with the same
    judgement. Two things are reported, not asserted (docs/performance.md, "Power cuts"):
    after some cuts of all three nodes nats-server leaves a stream without a leader (once in
    ten measured), and the namespace that needs it waits; and a live worker's step may be
    taken over after the seconds without a quorum of a node crash beside a cut-off node."""
    print(f"JETLOOP_KILL_SEED={SEED}")
    rounds = 1 if mode == "power_loss" else 2  # the cluster's rounds take its failures in turn
    report = await run_trials(mode, rounds, SEED, None, work_dir=tmp_path / "run")
    # The control's cut comes 2.6–3 s into its round (seed 5, in either mode): a cut in the
    # first fraction of a second may find nothing yet written to lose.
    control = await run_trials(
        mode, 1, CONTROL_SEED, None, work_dir=tmp_path / "control", sync="2m", control=True
    )
    print(format_reports([report, control]))
    assert report.sync == "always" and control.sync == "2m"
    assert report.in_flight >= 1, "no turn was in flight at the cut"
    assert report.duplicates == [], report.duplicates
    assert report.reverted == [], report.reverted
    assert report.stray_keys == [], "a write reached the vendor under a key no call owns"
    gone = [lost for lost in report.lost if "after a power cut" in lost]
    assert gone == [], gone
    if mode == "power_loss":
        assert report.lost == [], report.lost
        assert report.false_takeovers == [], report.false_takeovers
        assert report.ok
    assert control.harmed and control.ok, "the lazy control lost nothing: the cut did not bite"
    if mode == "cluster_power_loss":
        beside = "node_crash+pause" if NETNS is not None else "node_crash+partition"
        assert [r.failure for r in report.trials] == ["cluster_power_cut", beside]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(NETNS is not None, reason=f"network faults need namespaces: {NETNS}")
async def test_cluster_fault_trials(tmp_path: Path) -> None:
    """Network faults between the three nodes (partitions of the leader or a follower, one-way
    loss, a flapping link, the leader paused; jetloop.tooling.trials.faults) under turns in
    flight: every turn ends completed, no write applies twice, and no live worker's step is
    taken over but a cut-off one's — or, as documented (docs/design.md, "What is not
    promised"), one whose claim could not be renewed while an election ran past the lease
    (1 round in 100 measured, docs/performance.md); the rounds' faults are healed."""
    print(f"JETLOOP_KILL_SEED={SEED}")
    report = await run_trials("cluster_faults", 3, SEED, None, work_dir=tmp_path / "run")
    print(format_reports([report]))
    assert report.in_flight >= 1, "no turn was in flight at any fault"
    assert report.lost == [], report.lost
    assert report.duplicates == [], report.duplicates
    assert report.stray_keys == [], "a write reached the vendor under a key no call owns"
    for rnd in report.trials:
        if rnd.false_takeovers:
            ran_past = rnd.election is not None and rnd.election > report.lease_seconds
            assert ran_past or rnd.leaderless, rnd
    # The faults are taken in turn, so every round strikes another.
    faults = [r.failure for r in report.trials]
    assert len(set(faults)) == len(faults) and set(faults) <= set(NETWORK_FAULTS), faults
