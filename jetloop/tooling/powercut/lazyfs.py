"""A filesystem that loses what was not fsynced: power cuts under a nats-server's store.

After Jepsen's LazyFS. A FUSE daemon (``python -m jetloop.tooling.powercut.lazyfs ROOT``,
``mfusepy`` on libfuse 3) mounts ``ROOT/mnt`` as a passthrough of ``ROOT/live``, and keeps
a second tree, ``ROOT/durable``: what the disk would still hold after the power went out.

What it models, and when each thing becomes durable:

- **File data: when the file is fsynced** (``fsync``/``fdatasync``; a write through a
  descriptor opened ``O_SYNC``/``O_DSYNC`` is synced as it returns). Until then the daemon
  records, per file, the byte ranges written and the lowest size a truncate left; the sync
  copies those ranges from ``live`` into ``durable`` at the same offsets and gives the
  durable file the live size. ``close`` (FUSE ``flush``) is not a sync.
- **Metadata: at once** (create, mkdir, unlink, rmdir, rename, symlink, chmod, chown,
  utimens), as a journalling filesystem commits it within moments: a created file is
  durable and empty, a renamed file keeps its durable content under the new name (and its
  unsynced ranges move with it). A directory fsync therefore has nothing left to do.
- **A cut** (``LazyFS.cut()``) discards every unsynced write and truncate: ``live`` is
  replaced by a copy of ``durable``. ``torn=True`` lets part of the unsynced data reach the
  disk first: a random prefix of one unsynced range of one random file.

What it does not model: metadata that is lost or reordered (a rename that did not reach
the journal), the disk's own volatile cache (a synced write is safe here), torn sectors
within a synced write, hard links (``link`` is not offered).

A file unlinked (or renamed over) while open is unlinked from ``durable`` at once and its data
never becomes durable, as on a disk. On the live side libfuse keeps it under a hidden name
(``.fuse_hidden*``) until its last descriptor closes (so that fstat and ftruncate on it keep
working), and as with any libfuse filesystem its directory cannot be removed until then
(ENOTEMPTY). A mount removes the hidden files a previous one left.

The caller kills whatever uses the mount (nats-server, workers) with SIGKILL first, then
calls ``cut()``, then ``mount()`` again and restarts the server on ``mountpoint``.
``unmount()`` is a clean shutdown instead: durable takes everything live holds. The daemon
stops the same way when the process that mounted it dies (its stdin pipe closes).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("jetloop.lazyfs")

MODULE = "jetloop.tooling.powercut.lazyfs"
LIVE, DURABLE, MNT = "live", "durable", "mnt"
# Files under ROOT through which the parent and the daemon talk (never inside the mount).
REQUEST = "cut-request.json"  # parent → daemon: torn or not, and the seed of the tear
REPORT = "cut-report.json"  # daemon → parent: what the cut discards
FLUSHED = "flushed"  # the daemon stopped cleanly and made durable equal to live
DAEMON_LOG = "daemon.log"

CUT_SIGNAL = signal.SIGUSR1
# The signals libfuse stops on (a clean unmount): kept away from the daemon's helper threads,
# so that one reaches a thread of the FUSE loop and ends it.
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
CHUNK = 1 << 20
# Dropped from the flags a file is opened with on the live side: O_APPEND would make pwrite
# append wherever the kernel asked to write (the kernel gives the offset of an append
# already), O_DIRECT would ask for aligned buffers.
STRIPPED_FLAGS = os.O_APPEND | getattr(os, "O_DIRECT", 0)
FUSE_CAP_WRITEBACK_CACHE = 1 << 16
HIDDEN = ".fuse_hidden"  # libfuse's name for a file unlinked while open (hard_remove off)


@dataclass(frozen=True)
class Cut:
    """What a power cut discarded."""

    files: tuple[str, ...]  # mount paths ("/a/b") with unsynced writes or truncates
    unsynced_bytes: int  # bytes written since their file's last fsync (within its size)
    torn_bytes: int = 0  # of those, how many reached the disk anyway (``torn=True``)
    torn_file: str | None = None

    @property
    def discarded_bytes(self) -> int:
        return self.unsynced_bytes - self.torn_bytes


@dataclass
class _Dirty:
    """A file's changes since its last fsync: written ranges (sorted, disjoint, [start,
    end)) and the lowest size a truncate left it at (None: not truncated)."""

    ranges: list[tuple[int, int]] = field(default_factory=list)
    low: int | None = None

    def wrote(self, start: int, end: int) -> None:
        kept: list[tuple[int, int]] = []
        for s, e in self.ranges:
            if e < start or s > end:
                kept.append((s, e))
            else:  # overlapping or touching: one range
                start, end = min(s, start), max(e, end)
        kept.append((start, end))
        kept.sort()
        self.ranges = kept

    def truncated(self, size: int) -> None:
        self.low = size if self.low is None else min(self.low, size)

    def unsynced(self, size: int) -> list[tuple[int, int]]:
        """The ranges as they stand in a file of ``size`` bytes now."""
        return [(s, min(e, size)) for s, e in self.ranges if s < size]


class _Ops:
    """The FUSE operations (mfusepy's fusepy-style API): every operation on ``live`` at
    once; metadata on ``durable`` too; data on ``durable`` at fsync. Errors are raised as
    ``OSError``, which mfusepy returns as the errno.

    One lock: an operation that changes either tree runs alone, so a sync or a cut never
    sees half of one (mfusepy runs the operations on libfuse's threads). Reads don't take it.

    mfusepy takes any attribute named as a FUSE operation for one (an attribute ``lock``
    became the ``lock`` operation): the state is kept under names with an underscore.
    """

    use_ns = True  # mfusepy: times as integer nanoseconds (float seconds are deprecated)

    def __init__(self, root: Path) -> None:
        self._root = root
        self._live = str(root / LIVE)
        self._durable = str(root / DURABLE)
        self._mutex = threading.Lock()
        self._dirty: dict[str, _Dirty] = {}
        self._sync_fds: set[int] = set()  # opened O_SYNC/O_DSYNC: every write is synced

    def _l(self, path: str) -> str:
        return os.path.join(self._live, path.lstrip("/"))

    def _d(self, path: str) -> str:
        return os.path.join(self._durable, path.lstrip("/"))

    @staticmethod
    def _named(path: str | None) -> str | None:
        """``path`` if it names a file that can become durable; None for a file unlinked
        while open (libfuse's hidden name, or no path): nothing of it ever will."""
        if path is None or os.path.basename(path).startswith(HIDDEN):
            return None
        return path

    # -- lifecycle ---------------------------------------------------------------------

    def init_with_config(self, conn: Any, config: Any) -> None:
        if conn is not None:
            # The kernel must hand every write to the daemon as it happens (write-through),
            # not hold it in its page cache: a written range is recorded when write returns.
            conn.want &= ~FUSE_CAP_WRITEBACK_CACHE
        if config is not None:
            # (hard_remove stays off: with it, a file unlinked while open has no path left,
            # and libfuse answers fstat and ftruncate on it with ESTALE.)
            # Only this mount changes live while it is mounted, so the kernel's caches of
            # names and attributes cannot go stale: libfuse's default timeouts stay. A name
            # that was not there is not cached at all (negative_timeout 0).
            config.entry_timeout = 1.0
            config.attr_timeout = 1.0
            config.negative_timeout = 0.0

    def destroy(self, path: str) -> None:
        """A clean unmount: what live holds is kept (a clean shutdown flushes), so durable
        takes every unsynced change."""
        with self._mutex:
            for p in list(self._dirty):
                try:
                    self._sync(p)
                except OSError:
                    self._dirty.pop(p, None)
            (self._root / FLUSHED).write_text("")

    # -- reads -------------------------------------------------------------------------

    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, Any]:
        st = os.lstat(self._l(path)) if path is not None else os.fstat(fh or -1)
        return {
            "st_mode": st.st_mode,
            "st_nlink": st.st_nlink,
            "st_uid": st.st_uid,
            "st_gid": st.st_gid,
            "st_size": st.st_size,
            "st_rdev": st.st_rdev,
            "st_blocks": st.st_blocks,
            "st_blksize": st.st_blksize,
            "st_atime": st.st_atime_ns,
            "st_mtime": st.st_mtime_ns,
            "st_ctime": st.st_ctime_ns,
        }

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._l(path))]

    def readlink(self, path: str) -> str:
        return os.readlink(self._l(path))

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._l(path))
        keys = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files")
        return {k: getattr(sv, k) for k in (*keys, "f_ffree", "f_favail", "f_flag", "f_namemax")}

    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    # -- files -------------------------------------------------------------------------

    def open(self, path: str, flags: int) -> int:
        with self._mutex:
            fd = os.open(self._l(path), flags & ~STRIPPED_FLAGS)
            if flags & os.O_TRUNC and self._named(path):  # libfuse 3: atomic_o_trunc
                self._dirty.setdefault(path, _Dirty()).truncated(0)
            if flags & os.O_DSYNC:  # O_SYNC includes it
                self._sync_fds.add(fd)
            return fd

    def create(self, path: str, mode: int, flags: int) -> int:
        with self._mutex:
            fd = os.open(self._l(path), (flags | os.O_CREAT) & ~STRIPPED_FLAGS, mode)
            os.close(os.open(self._d(path), os.O_WRONLY | os.O_CREAT, mode))
            self._dirty.pop(path, None)
            if flags & os.O_DSYNC:
                self._sync_fds.add(fd)
            return fd

    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        with self._mutex:
            n = os.pwrite(fh, data, offset)
            named = self._named(path)
            if named is not None:
                self._dirty.setdefault(named, _Dirty()).wrote(offset, offset + n)
                if fh in self._sync_fds:
                    self._sync(named)
            return n

    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        with self._mutex:
            if fh is not None:
                os.ftruncate(fh, length)
            elif path is not None:
                os.truncate(self._l(path), length)
            else:
                raise OSError(errno.ESTALE, "neither a path nor a file handle")
            named = self._named(path)
            if named is not None:
                self._dirty.setdefault(named, _Dirty()).truncated(length)
            return 0

    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        with self._mutex:
            named = self._named(path)
            if named is not None:
                self._sync(named)
            return 0

    def fsyncdir(self, path: str | None, datasync: int, fh: int) -> int:
        return 0  # metadata is durable as it happens

    def release(self, path: str | None, fh: int) -> int:
        with self._mutex:  # with open(): the number is not reused before it leaves sync_fds
            self._sync_fds.discard(fh)
            os.close(fh)
            return 0

    def _sync(self, path: str) -> None:
        """Make ``path``'s unsynced changes durable (the lock is held)."""
        record = self._dirty.pop(path, None)
        if record is None:
            return
        src = os.open(self._l(path), os.O_RDONLY)
        try:
            dst = os.open(self._d(path), os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                size = os.fstat(src).st_size
                # Bytes past the lowest truncate that were not written since read as zeros
                # in live: cut durable there first, the ftruncate below extends with zeros.
                if record.low is not None and record.low < os.fstat(dst).st_size:
                    os.ftruncate(dst, record.low)
                for start, end in record.unsynced(size):
                    _copy(src, dst, start, end)
                # No fsync of durable: the cut is simulated from durable's contents, not by
                # the host losing power, so syncing it to the real disk would only slow every
                # fsync of the server on the mount.
                os.ftruncate(dst, size)
            finally:
                os.close(dst)
        finally:
            os.close(src)

    # -- metadata: both trees at once --------------------------------------------------

    def mkdir(self, path: str, mode: int) -> int:
        with self._mutex:
            os.mkdir(self._l(path), mode)
            os.mkdir(self._d(path), mode)
            return 0

    def rmdir(self, path: str) -> int:
        with self._mutex:
            os.rmdir(self._l(path))
            os.rmdir(self._d(path))
            return 0

    def unlink(self, path: str) -> int:
        with self._mutex:
            os.unlink(self._l(path))
            if self._named(path):  # a hidden file left durable when it was hidden
                os.unlink(self._d(path))
            self._dirty.pop(path, None)
            return 0

    def rename(self, old: str, new: str) -> int:
        with self._mutex:
            os.rename(self._l(old), self._l(new))
            self._dirty.pop(new, None)
            if not self._named(new):
                # libfuse hides a file unlinked (or renamed over) while open: for the disk
                # that is the unlink, and its unsynced data is lost with it.
                os.unlink(self._d(old))
                self._dirty.pop(old, None)
                return 0
            os.rename(self._d(old), self._d(new))
            # The records go with the names: the file itself, or all under a directory.
            for p in [p for p in self._dirty if p == old or p.startswith(old + "/")]:
                self._dirty[new + p[len(old) :]] = self._dirty.pop(p)
            return 0

    def symlink(self, target: str, source: str) -> int:
        """mfusepy's order: ``target`` is the new link's path, ``source`` what it points to."""
        with self._mutex:
            os.symlink(source, self._l(target))
            os.symlink(source, self._d(target))
            return 0

    def chmod(self, path: str | None, mode: int) -> int:
        with self._mutex:
            for p in self._both(path):
                os.chmod(p, mode, follow_symlinks=False)
            return 0

    def chown(self, path: str | None, uid: int, gid: int) -> int:
        with self._mutex:
            for p in self._both(path):
                os.chown(p, uid, gid, follow_symlinks=False)
            return 0

    def utimens(self, path: str | None, times: tuple[int, int] | None = None) -> int:
        with self._mutex:
            for p in self._both(path):
                if times is None:
                    os.utime(p, follow_symlinks=False)
                else:
                    os.utime(p, ns=times, follow_symlinks=False)
            return 0

    def _both(self, path: str | None) -> list[str]:
        if path is None:  # (no path and, from mfusepy, no descriptor either)
            return []
        return [self._l(path), self._d(path)] if self._named(path) else [self._l(path)]

    # -- the cut -----------------------------------------------------------------------

    def cut(self) -> None:
        """The power goes out: take the lock for good (no operation runs after this), let
        part of the unsynced data through if asked, report what is lost, and end at once."""
        request = json.loads((self._root / REQUEST).read_text())
        self._mutex.acquire()
        try:
            report = self._tally()
            if request.get("torn"):
                report |= self._tear(random.Random(request.get("seed")))
            _write_json(self._root / REPORT, report)
        except BaseException:
            # Still a cut: the parent finds no report and says so, with this in the log.
            traceback.print_exc()
            os._exit(1)
        os._exit(0)

    def _sizes(self) -> dict[str, int]:
        sizes = {}
        for p in self._dirty:
            try:
                sizes[p] = os.stat(self._l(p)).st_size
            except OSError:
                sizes[p] = 0
        return sizes

    def _tally(self) -> dict[str, Any]:
        sizes = self._sizes()
        unsynced = sum(
            e - s for p, r in self._dirty.items() for s, e in r.unsynced(sizes[p]) if e > s
        )
        files = sorted(p for p, r in self._dirty.items() if r.ranges or r.low is not None)
        return {"files": files, "unsynced_bytes": unsynced}

    def _tear(self, rng: random.Random) -> dict[str, Any]:
        """A random prefix of one unsynced range of one random file reaches durable (a
        range that starts past the durable end leaves zeros before it, as a disk's block
        written ahead of the size would)."""
        sizes = self._sizes()
        candidates = sorted(
            p for p, r in self._dirty.items() if any(e > s for s, e in r.unsynced(sizes[p]))
        )
        if not candidates:
            return {"torn_bytes": 0, "torn_file": None}
        path = rng.choice(candidates)
        start, end = rng.choice(
            [(s, e) for s, e in self._dirty[path].unsynced(sizes[path]) if e > s]
        )
        length = rng.randint(1, end - start)
        src = os.open(self._l(path), os.O_RDONLY)
        try:
            dst = os.open(self._d(path), os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                _copy(src, dst, start, start + length)
                os.fsync(dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        return {"torn_bytes": length, "torn_file": path}


def _copy(src: int, dst: int, start: int, end: int) -> None:
    pos = start
    while pos < end:
        data = os.pread(src, min(CHUNK, end - pos), pos)
        if not data:
            break
        os.pwrite(dst, data, pos)
        pos += len(data)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """Whole or not at all: the reader never sees half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


# -- the daemon ----------------------------------------------------------------------------


def _helper(target: Callable[[], None]) -> None:
    """Run ``target`` in a thread that never takes the stop signals (see STOP_SIGNALS)."""

    def run() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        target()

    threading.Thread(target=run, daemon=True).start()


def serve(root: Path) -> None:
    """The daemon: mount ``root/mnt`` and serve it until unmounted, stopped (SIGTERM: a
    clean stop) or cut (SIGUSR1, see ``_Ops.cut``)."""
    from mfusepy import FUSE  # type: ignore[import-untyped]

    ops = _Ops(root)
    # The cut signal is taken by sigwait in a thread of ours, not by a handler: Python runs
    # handlers in the main thread, which is inside libfuse's loop until the end. Blocked
    # before any thread starts, so every thread (libfuse's too) inherits the block.
    signal.pthread_sigmask(signal.SIG_BLOCK, {CUT_SIGNAL})

    def await_cut() -> None:
        signal.sigwait({CUT_SIGNAL})
        ops.cut()

    _helper(await_cut)
    if stat.S_ISFIFO(os.fstat(0).st_mode):
        # stdin is a pipe from the LazyFS that started us: when it closes (that process is
        # gone, however it ended), stop cleanly rather than leave a mount nobody serves.
        def lifeline() -> None:
            while os.read(0, 4096):
                pass
            os.kill(os.getpid(), signal.SIGTERM)

        _helper(lifeline)
    try:
        FUSE(ops, str(root / MNT), foreground=True, fsname="lazyfs")
    except RuntimeError:
        # libfuse reports the stop signal as an error code; a clean stop it still is once
        # destroy has flushed.
        if not (root / FLUSHED).exists():
            raise


# -- the parent's side ---------------------------------------------------------------------


def _mounted(path: Path) -> bool:
    """Whether a filesystem is mounted on ``path``, also a dead FUSE mount (whose stat fails
    with ENOTCONN, so ``os.path.ismount`` says False)."""
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4]
            # mountinfo escapes space, tab, newline and backslash as octal.
            for esc, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
                point = point.replace(esc, ch)
            if point == target:
                return True
    return False


class LazyFS:
    """A lazy filesystem under ``root``: ``live/`` (what the mount shows), ``durable/`` (what
    survives a cut) and ``mnt/`` (the mount point), and the daemon that serves it.

    ``with LazyFS(root) as fs:`` mounts and, at the end, unmounts cleanly.
    """

    def __init__(self, root: Path) -> None:
        # The real path: it is compared with the kernel's mount table.
        self.root = Path(os.path.realpath(root))
        for name in (LIVE, DURABLE, MNT):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def mountpoint(self) -> Path:
        return self.root / MNT

    @property
    def live(self) -> Path:
        return self.root / LIVE

    @property
    def durable(self) -> Path:
        return self.root / DURABLE

    def daemon_log(self) -> str:
        try:
            return (self.root / DAEMON_LOG).read_text(errors="replace")
        except OSError:
            return ""

    def mount(self, timeout: float = 10.0) -> None:
        """Start the daemon and wait until the mount answers. Mounted already: nothing."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self._proc = None
        self._detach()  # a mount left by a daemon that died
        for name in (REQUEST, REPORT, FLUSHED):
            (self.root / name).unlink(missing_ok=True)
        # Files unlinked while open when the last daemon stopped (a clean stop with the
        # server still running): gone on a disk once it is mounted again.
        for hidden in self.live.rglob(HIDDEN + "*"):
            hidden.unlink()
        with open(self.root / DAEMON_LOG, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", MODULE, str(self.root)],
                stdin=subprocess.PIPE,  # the lifeline (see serve)
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl-C is not for it
            )
        self._proc = proc
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mountpoint):
            if proc.poll() is not None:
                self._proc = None
                self._end(proc, 0)
                raise RuntimeError(
                    f"the lazyfs daemon exited with code {proc.returncode} before it mounted"
                    f" {self.mountpoint}:\n{self.daemon_log()}"
                )
            if time.monotonic() > deadline:
                self._end(proc, 0)
                self._detach()
                raise TimeoutError(
                    f"lazyfs did not mount {self.mountpoint} within {timeout}s:\n"
                    f"{self.daemon_log()}"
                )
            time.sleep(0.01)

    def cut(
        self, torn: bool = False, rng: random.Random | None = None, timeout: float = 10.0
    ) -> Cut:
        """The power cut: the daemon stops where it is (holding its lock, so between two
        operations), lets part of the unsynced data through if ``torn``, and reports; the
        mount goes, and ``live`` becomes a copy of ``durable``. Kill the mount's users first.
        """
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"lazyfs is not mounted on {self.mountpoint}: nothing to cut")
        seed = (rng or random.Random()).getrandbits(64)
        _write_json(self.root / REQUEST, {"torn": torn, "seed": seed})
        (self.root / REPORT).unlink(missing_ok=True)
        os.kill(proc.pid, CUT_SIGNAL)
        self._end(proc, timeout)
        self._proc = None
        self._detach()
        try:
            report = json.loads((self.root / REPORT).read_text())
        except (OSError, ValueError):
            report = None
        # live := durable (what the disk holds when the power comes back).
        shutil.rmtree(self.live)
        shutil.copytree(self.durable, self.live, symlinks=True)
        if report is None:
            raise RuntimeError(
                f"the lazyfs daemon did not report the cut (exit {proc.returncode}); the cut"
                f" is done, what it discarded is unknown:\n{self.daemon_log()}"
            )
        done = Cut(
            files=tuple(report["files"]),
            unsynced_bytes=report["unsynced_bytes"],
            torn_bytes=report.get("torn_bytes", 0),
            torn_file=report.get("torn_file"),
        )
        log.info(
            "lazyfs.cut",
            root=str(self.root),
            files=len(done.files),
            unsynced_bytes=done.unsynced_bytes,
            torn_bytes=done.torn_bytes,
        )
        return done

    def unmount(self, timeout: float = 10.0) -> None:
        """A clean stop: everything in live is kept (durable made equal to it), the mount
        goes. Not mounted: nothing (a mount left by a dead daemon is removed)."""
        proc, self._proc = self._proc, None
        if proc is None:
            self._detach()
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # libfuse unmounts, then destroy flushes
        self._end(proc, timeout)
        self._detach()
        if not (self.root / FLUSHED).exists():
            # The daemon died, or was killed before it flushed: the clean stop copies.
            shutil.rmtree(self.durable)
            shutil.copytree(self.live, self.durable, symlinks=True)

    def __enter__(self) -> LazyFS:
        self.mount()
        return self

    def __exit__(self, *exc: object) -> None:
        self.unmount()

    @staticmethod
    def _end(proc: subprocess.Popen[bytes], timeout: float) -> None:
        """Wait for the daemon to end (SIGKILL after ``timeout``), and close its lifeline."""
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()

    def _detach(self) -> None:
        """Unmount ``mnt`` if anything is mounted there; lazily if it is busy (a process
        still has a file or its working directory in it)."""
        mnt = self.mountpoint
        if not _mounted(mnt):
            return
        for args in (["-u"], ["-uz"]):
            subprocess.run(["fusermount3", *args, str(mnt)], capture_output=True, check=False)
            if not _mounted(mnt):
                return
        raise RuntimeError(f"could not unmount {mnt}")


@cache
def unavailable() -> str | None:
    """Why a LazyFS cannot be mounted here (no /dev/fuse, no fusermount3, no mfusepy or
    libfuse 3, mounting not permitted), or None. Tries a mount once per process."""
    if not sys.platform.startswith("linux"):
        return "LazyFS needs Linux's FUSE"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "no fusermount3 (Debian: apt install fuse3)"
    import importlib.util

    if importlib.util.find_spec("mfusepy") is None:
        return "mfusepy is not installed (pip install mfusepy)"
    with tempfile.TemporaryDirectory(prefix="lazyfs-probe-") as d:
        fs = LazyFS(Path(d))
        try:
            fs.mount()
        except Exception as exc:
            return f"cannot mount a FUSE filesystem here: {exc}"
        finally:
            fs.unmount()
    return None


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python -m {MODULE} ROOT")
    serve(Path(sys.argv[1]))
