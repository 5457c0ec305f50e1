"""What a server syncs to disk per turn, counted from outside: ``strace`` on its process.

A server that syncs before it acknowledges (nats-server with ``sync_interval: always``, Restate
always) pays one sync per write it must keep, unless it commits several writes with one.
What a turn costs in syncs, and where, says which writes to fold or spread; a count from the
kernel's side says it whatever each server's own statistics report.

The bench starts the server under ``strace -f --seccomp-bpf`` (``prefix``): only the calls
that sync (``fsync``, ``fdatasync``, ``sync_file_range``) and the opens stop the process, so
the trace costs little beside them. An open with ``O_SYNC`` counts as a sync: every write to
that file is synchronous (nats-server writes its consumer state and meta files so, whole,
then syncs their directory). Each call is stamped (``-ttt``) and timed (``-T``), so the bench
splits the trace by the batches it ran (``Window``) and divides by their turns.

Where a sync lands (``nats_where``, ``restate_where``):

- nats-server: ``<stream> messages`` is a message block's ``fsync``, made before the server
  answers the publish that stored the message: on the path of whoever waits for that
  acknowledgement. ``<stream> consumers`` is a consumer's state (acks, deliveries) written by
  the consumer's flusher, ``<stream> index`` a stream's index or meta files: off that path.
- Restate: a RocksDB write-ahead log (``*.log``: its log server's or its partition store's),
  synced before an entry is acknowledged: on the path; table files, manifests and the rest:
  off it.
"""

from __future__ import annotations

import re
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

# The calls that make data durable, and the open that can make every write durable.
SYNC_CALLS = ("fsync", "fdatasync", "sync_file_range")
TRACED = ",".join((*SYNC_CALLS, "openat"))
O_SYNC = "o_sync"  # ``SyncCall.how`` of a file opened for synchronous writes

# ``<pid> <epoch>.<us> <call>(<fd></path>>...) = <ret> <<seconds>>``; an open names its path in
# its result (``= 13</path>``).
_LINE = re.compile(
    r"^\d+\s+(?P<at>\d+\.\d+)\s+(?P<call>\w+)\((?P<args>.*)\)\s+=\s+(?P<ret>-?\d+)"
    r"(?:<(?P<ret_path>[^>]*)>)?.*?(?:<(?P<secs>\d+\.\d+)>)?$"
)
_FD_PATH = re.compile(r"^\d+<(?P<path>[^>]*)>")
# With several threads, a call another thread's line interrupts is printed in two halves:
# ``<pid> <ts> call(args <unfinished ...>``, then ``<pid> <ts> <... call resumed>rest``.
_UNFINISHED = re.compile(r"^(?P<pid>\d+)\s+(?P<at>\d+\.\d+)\s+(?P<head>.*) <unfinished \.\.\.>$")
_RESUMED = re.compile(r"^(?P<pid>\d+)\s+\d+\.\d+\s+<\.\.\. \w+ resumed>(?P<tail>.*)$")


@dataclass(frozen=True)
class SyncCall:
    """One sync the traced process made."""

    at: float  # when it began (seconds since the epoch)
    path: str  # the file (or directory) it made durable
    how: str  # fsync, fdatasync, sync_file_range, or O_SYNC (an open for synchronous writes)
    seconds: float  # how long the call took (0 for an open: its writes pay, unseen here)


def prefix(trace_file: Path) -> list[str]:
    """The command that starts a server under the trace, written to ``trace_file``. Raises
    ``RuntimeError`` where ``strace`` is not installed."""
    strace = shutil.which("strace")
    if strace is None:
        raise RuntimeError(
            "counting syncs needs strace (Debian: apt-get install strace), not found on PATH"
        )
    return [
        strace,
        "-f",  # every thread: a Go or Rust server syncs from many
        "--seccomp-bpf",  # only the traced calls stop the process
        "-qq",
        "-y",  # file descriptors with their paths
        "-ttt",
        "-T",
        "-e",
        f"trace={TRACED}",
        "-e",
        "signal=none",
        "-o",
        str(trace_file),
        "--",
    ]


def parse(lines: Iterable[str]) -> list[SyncCall]:
    """The syncs in a trace written by ``prefix``'s strace (failed calls left out)."""
    calls = []
    pending: dict[str, str] = {}  # pid → the first half of its interrupted call's line
    for raw in lines:
        line = raw.strip()
        if (u := _UNFINISHED.match(line)) is not None:
            pending[u["pid"]] = f"{u['pid']} {u['at']} {u['head']}"
            continue
        if (r := _RESUMED.match(line)) is not None:
            head = pending.pop(r["pid"], None)
            if head is None:
                continue
            line = head + r["tail"]
        m = _LINE.match(line)
        if m is None or int(m["ret"]) < 0:
            continue
        call, args = m["call"], m["args"]
        secs = float(m["secs"]) if m["secs"] else 0.0
        if call in SYNC_CALLS:
            fd = _FD_PATH.match(args)
            if fd is not None:
                calls.append(SyncCall(float(m["at"]), fd["path"], call, secs))
        elif call == "openat" and "O_SYNC" in args and m["ret_path"]:
            calls.append(SyncCall(float(m["at"]), m["ret_path"], O_SYNC, 0.0))
    return calls


def read(trace_file: Path) -> list[SyncCall]:
    """``parse`` of a trace file (none yet: no syncs)."""
    if not trace_file.exists():
        return []
    with trace_file.open(encoding="utf-8", errors="replace") as f:
        return parse(f)


# --- where a sync lands ---------------------------------------------------------------------

ON_PATH = "on the path"
OFF_PATH = "off the path"


def nats_where(path: str) -> tuple[str, str]:
    """(what, on or off the acknowledgement's path) of a sync in a nats-server store:
    ``…/jetstream/<account>/streams/<stream>/msgs/<n>.blk`` and so on."""
    parts = PurePosixPath(path).parts
    if "streams" not in parts:
        return "server files", OFF_PATH
    i = parts.index("streams")
    rest = parts[i + 1 :]
    if not rest:
        return "server files", OFF_PATH
    stream = rest[0]
    if len(rest) >= 3 and rest[1] == "msgs" and rest[2].endswith(".blk"):
        return f"{stream} messages", ON_PATH
    if len(rest) >= 2 and rest[1] == "obs":
        return f"{stream} consumers", OFF_PATH
    return f"{stream} index", OFF_PATH


def restate_where(base: Path) -> Callable[[str], tuple[str, str]]:
    """(what, on or off the path) of a sync in a Restate server's data directory ``base``:
    the directory under it (its log server's, its partition store's, its metadata's) and
    whether the file is a RocksDB write-ahead log."""
    root = str(base)

    def where(path: str) -> tuple[str, str]:
        rel = path[len(root) :].lstrip("/") if path.startswith(root) else path
        parts = PurePosixPath(rel).parts
        # <node>/<store>/…: the store names what it is (log-store, db, metadata, …).
        store = parts[1] if len(parts) > 2 else (parts[0] if parts else "?")
        if rel.endswith(".log"):
            return f"{store} write-ahead log", ON_PATH
        return f"{store} files", OFF_PATH

    return where


# --- per turn -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """A batch of turns of one system on one load, and when it ran (``time.time()``)."""

    system: str
    load: str
    start: float
    end: float
    turns: int


@dataclass
class Syncs:
    """Syncs per turn of one system on one load: by where, and the time they took."""

    turns: int
    by_where: dict[str, float]  # what → syncs per turn
    on_path: list[str]  # the whats on the acknowledgement's path
    seconds_per_sync: float  # mean time of a sync call (O_SYNC opens excluded)
    # stream → messages it stored per turn, where the bench could count them (nats-server).
    stored: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.by_where.values())

    def total_on_path(self) -> float:
        return sum(v for what, v in self.by_where.items() if what in self.on_path)


def per_turn(
    calls: list[SyncCall],
    windows: Iterable[Window],
    where: Callable[[str], tuple[str, str]],
    stored: Mapping[tuple[str, str], Mapping[str, int]] | None = None,
) -> dict[str, dict[str, Syncs]]:
    """load → system → ``Syncs``: the calls inside each of that system's windows, per turn of
    those windows. A window's syncs are only its system's (the systems' batches alternate,
    never overlap, and each trace is one server's). ``stored``: (load, system) → stream →
    messages stored during those windows, where the bench counted them."""
    grouped: dict[tuple[str, str], list[Window]] = defaultdict(list)
    for w in windows:
        grouped[(w.load, w.system)].append(w)
    out: dict[str, dict[str, Syncs]] = defaultdict(dict)
    for (load, system), ws in grouped.items():
        turns = sum(w.turns for w in ws)
        inside = [c for c in calls if any(w.start <= c.at <= w.end for w in ws)]
        counts: dict[str, int] = defaultdict(int)
        on_path: set[str] = set()
        for c in inside:
            what, path = where(c.path)
            counts[what] += 1
            if path == ON_PATH:
                on_path.add(what)
        timed = [c.seconds for c in inside if c.how != O_SYNC]
        out[load][system] = Syncs(
            turns=turns,
            by_where={k: v / turns for k, v in sorted(counts.items())} if turns else {},
            on_path=sorted(on_path),
            seconds_per_sync=sum(timed) / len(timed) if timed else 0.0,
            stored={
                stream: n / turns
                for stream, n in sorted((stored or {}).get((load, system), {}).items())
                if n and turns
            },
        )
    return dict(out)


def format_syncs(syncs: dict[str, dict[str, Syncs]]) -> list[str]:
    """Markdown: per load, a row per (system, where) with syncs per turn."""
    if not syncs:
        return []
    lines = [
        "",
        "Syncs to disk per turn, counted by strace on each server (timings under the trace"
        " are slower: read the counts):",
        "",
        "| load | system | where | on the acknowledgement's path? | syncs per turn |"
        " messages stored per turn |",
        "|---|---|---|---|---:|---:|",
    ]
    for load, systems in syncs.items():
        for system, s in systems.items():
            for what, n in sorted(s.by_where.items(), key=lambda kv: -kv[1]):
                path = "yes" if what in s.on_path else "no"
                stream, _, kind = what.rpartition(" ")
                kept = s.stored.get(stream) if kind == "messages" else None
                cell = f"{kept:.2f}" if kept is not None else ""
                lines.append(f"| {load} | {system} | {what} | {path} | {n:.2f} | {cell} |")
            all_stored = f"**{sum(s.stored.values()):.2f}**" if s.stored else ""
            lines.append(
                f"| {load} | {system} | **all** ({s.total_on_path():.2f} on the path; a sync"
                f" call took {s.seconds_per_sync * 1000:.2f} ms on average) | |"
                f" **{s.total:.2f}** | {all_stored} |"
            )
    return lines
