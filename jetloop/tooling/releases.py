"""The previous release, built from this repository's own history, to run beside this one.

An upgrade is tested by running the release a deployment upgrades *from* next to the current
code on one store (``tests/test_upgrade.py``, ``jetloop trials --mode upgrade``). That release
is named here by the commit it was made from (``CHANGELOG.md`` lists the same commit), and
built from the repository's history with ``git archive``: no download, no second install.

A built release is a directory holding its ``jetloop`` package and its ``tests`` (whose test
agents are the ones that release's workers load). It runs on this interpreter and its
packages (the dependencies of 0.1.0 are a subset of this release's), with the directory first
on ``PYTHONPATH`` and ``python -P`` so that the working directory never puts the current
package in front of it.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Release:
    version: str
    commit: str


# The release this one upgrades from (CHANGELOG.md: "0.1.0 — commit 5bcd861").
PREVIOUS = Release("0.1.0", "5bcd86168b1e79f9a165b77feb4c26449e273fd2")
# What a built release holds: its package and its test agents.
_PARTS = ("jetloop", "tests")


class ReleaseUnavailable(RuntimeError):
    """The release's commit cannot be read here; ``shallow`` says whether the clone is one."""

    def __init__(self, message: str, *, shallow: bool) -> None:
        super().__init__(message)
        self.shallow = shallow


def repository() -> Path:
    """The git work tree this package was loaded from."""
    root = Path(__file__).resolve().parents[2]  # <root>/jetloop/tooling/releases.py
    if not (root / ".git").exists():
        raise ReleaseUnavailable(
            f"{root} is not a git work tree: a release is built from the repository's history",
            shallow=False,
        )
    return root


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, check=False)


@dataclass(frozen=True)
class BuiltRelease:
    release: Release
    root: Path

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with the release first on the path."""
        env = dict(os.environ if base is None else base)
        rest = env.get("PYTHONPATH")
        env["PYTHONPATH"] = f"{self.root}{os.pathsep}{rest}" if rest else str(self.root)
        return env

    def cli(self, *args: str) -> list[str]:
        """The release's ``jetloop`` command line (``-P``: the working directory stays off
        ``sys.path``, so this repository's package cannot shadow the release's)."""
        return [sys.executable, "-P", "-m", "jetloop.services.cli", *args]


def build(dest: Path, release: Release = PREVIOUS) -> BuiltRelease:
    """The release's tree under ``dest/<version>`` (made once; a finished tree is reused)."""
    root = dest / release.version
    done = root / ".built"
    if done.exists() and done.read_text() == release.commit:
        return BuiltRelease(release, root)
    repo = repository()
    if _git(repo, "cat-file", "-e", f"{release.commit}^{{commit}}").returncode != 0:
        shallow = _git(repo, "rev-parse", "--is-shallow-repository").stdout.strip() == b"true"
        raise ReleaseUnavailable(
            f"release {release.version} (commit {release.commit[:7]}) is not in {repo}'s history"
            + (": this is a shallow clone (git fetch --unshallow)" if shallow else ""),
            shallow=shallow,
        )
    archive = _git(repo, "archive", "--format=tar", release.commit, *_PARTS)
    if archive.returncode != 0:
        raise ReleaseUnavailable(archive.stderr.decode(errors="replace").strip(), shallow=False)
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(root, filter="data")
    done.write_text(release.commit)
    return BuiltRelease(release, root)
