"""Counting a server's syncs to disk (``jetloop.tooling.bench.syncs``): the trace's lines read
right, and a real nats-server that syncs always is seen syncing once per stored message."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import nats
import pytest

from jetloop.services.embedded import EmbeddedServer
from jetloop.tooling.bench import syncs

STORE = "/tmp/x/store/nats/jetstream/$G/streams"
TRACE = f"""\
101 1796447192.710425 fsync(9<{STORE}/S/msgs/1.blk>) = 0 <0.000412>
101 1796447192.711330 fsync(9<{STORE}/S/msgs/1.blk>) = 0 <0.000388>
102 1796447192.722341 openat(AT_FDCWD</tmp>, "{STORE}/S/obs/c/o.dat.tmp", \
O_WRONLY|O_CREAT|O_TRUNC|O_SYNC|O_CLOEXEC, 0600) = 11<{STORE}/S/obs/c/o.dat.tmp> <0.000020>
102 1796447192.723181 fsync(11<{STORE}/S/obs/c>) = 0 <0.000101>
103 1796447192.727360 openat(AT_FDCWD</tmp>, "{STORE}/S/obs/c/o.dat", O_RDONLY|O_CLOEXEC) \
= 11<{STORE}/S/obs/c/o.dat> <0.000010>
103 1796447192.727400 openat(AT_FDCWD</tmp>, "/nope", O_RDONLY|O_SYNC) = -1 ENOENT (No such \
file or directory) <0.000010>
104 1796447193.804630 fsync(8<{STORE}/KV_b/msgs>) = 0 <0.000200>
104 1796447199.000000 fsync(8<{STORE}/KV_b/msgs/2.blk>) = 0 <0.000200>
"""


def test_a_trace_reads_as_syncs_by_where() -> None:
    """Each fsync names its file; an O_SYNC open counts once; plain and failed opens do not;
    the calls are split by the batch windows and divided by their turns."""
    calls = syncs.parse(TRACE.splitlines())
    assert [c.how for c in calls] == ["fsync", "fsync", syncs.O_SYNC, "fsync", "fsync", "fsync"]
    windows = [syncs.Window("jetloop", "sequential", 1796447192.7, 1796447194.0, 2)]
    stored = {("sequential", "jetloop"): {"S": 3, "KV_b": 0}}
    got = syncs.per_turn(calls, windows, syncs.nats_where, stored)["sequential"]["jetloop"]
    assert got.by_where == {"S messages": 1.0, "S consumers": 1.0, "KV_b index": 0.5}
    assert got.on_path == ["S messages"]
    assert got.total == 2.5 and got.total_on_path() == 1.0
    # The time of the fsync calls only (an O_SYNC open's writes are not seen).
    assert got.seconds_per_sync == pytest.approx((0.000412 + 0.000388 + 0.000101 + 0.0002) / 4)
    assert got.stored == {"S": 1.5}  # a stream that stored nothing is left out
    table = syncs.format_syncs({"sequential": {"jetloop": got}})
    assert "| sequential | jetloop | S messages | yes | 1.00 | 1.50 |" in table
    assert "| sequential | jetloop | S consumers | no | 1.00 |  |" in table


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
async def test_a_server_that_syncs_always_syncs_each_stored_message(tmp_path: Path) -> None:
    """A real nats-server with sync_interval always, traced as the bench traces it: 20
    publishes to one stream are 20 syncs of that stream's messages, made while they ran."""
    conf = tmp_path / "server.conf"
    conf.write_text("jetstream { sync_interval: always }\n")
    trace = tmp_path / "syncs.trace"
    server = EmbeddedServer(
        tmp_path / "store",
        port=0,
        log_file=tmp_path / "nats.log",
        config_file=conf,
        wrap=syncs.prefix(trace),
    )
    await asyncio.to_thread(server.start)
    try:
        await server.wait_jetstream()
        assert server.server_pid() not in (None, server.proc.pid if server.proc else None)
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="COUNTED", subjects=["counted.>"])
        start = time.time()
        for i in range(20):
            await js.publish("counted.x", str(i).encode())
        end = time.time()
        await nc.close()
    finally:
        await asyncio.to_thread(server.stop, 30.0)
        server.kill()
    got = syncs.per_turn(
        syncs.read(trace), [syncs.Window("s", "seq", start, end, 20)], syncs.nats_where
    )["seq"]["s"]
    assert got.by_where["COUNTED messages"] == 1.0
    assert got.on_path == ["COUNTED messages"]


def test_restate_syncs_are_named_by_their_store() -> None:
    """A Restate data directory's ``<node>/<store>/…``: a RocksDB ``*.log`` is its store's
    write-ahead log, on the acknowledgement's path; anything else is off it."""
    where = syncs.restate_where(Path("/tmp/r/data"))
    assert where("/tmp/r/data/bench/log-store/000012.log") == (
        "log-store write-ahead log",
        syncs.ON_PATH,
    )
    assert where("/tmp/r/data/bench/db/MANIFEST-000005") == ("db files", syncs.OFF_PATH)


def test_a_call_interrupted_by_another_threads_line_is_read_whole() -> None:
    """strace prints a call that another thread's line interrupts in two halves; both
    halves make one sync (a fsync and an O_SYNC open), each on its own thread's pid."""
    lines = [
        f"7 1.000000 fsync(25<{STORE}/S/msgs/1.blk> <unfinished ...>",
        f'8 1.000100 openat(AT_FDCWD</w>, "{STORE}/S/obs/c/o.dat.tmp", O_WRONLY|O_SYNC'
        " <unfinished ...>",
        "7 1.000200 <... fsync resumed>) = 0 <0.000371>",
        f"8 1.000300 <... openat resumed>, 0600) = 11<{STORE}/S/obs/c/o.dat.tmp> <0.000020>",
    ]
    calls = syncs.parse(lines)
    assert [(c.how, c.path.rsplit("/", 1)[-1], c.at) for c in calls] == [
        ("fsync", "1.blk", 1.0),
        (syncs.O_SYNC, "o.dat.tmp", 1.0001),
    ]
    assert calls[0].seconds == pytest.approx(0.000371)
