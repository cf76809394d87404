"""The previous release as real processes, for the rolling-upgrade tests and the bench.

``deploy/PREVIOUS_RELEASE`` names a commit of this repository. ``prepare`` checks it out from
the repository's own history (``git worktree add --detach``; a clean clone of main has it)
into ``.turnstore/releases/<commit>/src`` and installs it into a venv of its own beside it,
``.turnstore/releases/<commit>/venv``, as its image would be built: its own
``deploy/requirements.lock`` without dependency resolution, then the release itself (not
editable). Both are kept and reused by later runs: the venv counts only once it is complete
(a stamp written last), and a file lock keeps two test runs from building it at once.

A release serves as ``<venv>/bin/turnstore serve`` with a clean environment (nothing of this
checkout on its path) on a free loopback port, and runs its own ``turnstore db ...``.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.cluster import Replica, free_port, process

REPO = Path(__file__).resolve().parents[2]
PREVIOUS_RELEASE = REPO / "deploy" / "PREVIOUS_RELEASE"
CACHE = REPO / ".turnstore" / "releases"
INSTALL_TIMEOUT_S = 900


class Unavailable(Exception):
    """The commit is not in this clone (a shallow clone) or git is missing."""


def _git(*args: str) -> str:
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=120
        )
    except FileNotFoundError as exc:
        raise Unavailable("git is not installed") from exc
    if done.returncode != 0:
        raise Unavailable(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def previous_commit() -> str:
    """The full id of the commit deploy/PREVIOUS_RELEASE names."""
    lines = PREVIOUS_RELEASE.read_text().splitlines()
    named = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    if len(named) != 1:
        raise ValueError(f"{PREVIOUS_RELEASE} must name exactly one commit, got {named!r}")
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{named[0]}^{{commit}}")
    except Unavailable as exc:
        raise Unavailable(
            f"commit {named[0]} (deploy/PREVIOUS_RELEASE) is not in this clone: fetch the "
            "full history (git fetch --unshallow)"
        ) from exc


@dataclass(frozen=True)
class Release:
    commit: str
    root: Path  # the checkout
    venv: Path
    setup_s: float  # what prepare() took: a first install, or finding it ready

    @property
    def short(self) -> str:
        return self.commit[:7]

    @property
    def turnstore(self) -> str:
        return str(self.venv / "bin" / "turnstore")

    def env(self, **settings: str) -> dict[str, str]:
        """A clean environment: nothing of this checkout's (PYTHONPATH) or the developer's
        turnstore settings leaks in."""
        keep = ("PATH", "HOME", "LANG", "TMPDIR")
        env = {key: os.environ[key] for key in keep if key in os.environ}
        return {**env, "PYTHONUNBUFFERED": "1", **settings}

    def run(
        self, *args: str, timeout_s: float = 120, **settings: str
    ) -> subprocess.CompletedProcess[str]:
        """``turnstore ARGS`` of this release, to completion."""
        return subprocess.run(
            [self.turnstore, *args], env=self.env(**settings), cwd=self.root,
            capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip

    def head(self) -> str:
        """The release's schema head, as its own code states it."""
        code = "from service.migrate import head_revision; print(head_revision())"
        done = subprocess.run(
            [str(self.venv / "bin" / "python"), "-c", code], env=self.env(), cwd=self.root,
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return done.stdout.strip()

    @contextmanager
    def serve(self, log: Path, **settings: str) -> Iterator[Replica]:
        """``turnstore serve`` of this release on a free port, with ``settings`` as its
        environment (DATABASE_URL at least); stopped on the way out."""
        port = free_port()
        args = [self.turnstore, "serve", "--host", "127.0.0.1", "--port", str(port)]
        with process(args, log, self.env(**settings), cwd=self.root) as proc:
            yield Replica(f"http://127.0.0.1:{port}", proc)


def prepare(commit: str) -> Release:
    """The release at ``commit``, checked out and installed (once; reused later)."""
    started = time.monotonic()
    home = CACHE / commit
    home.mkdir(parents=True, exist_ok=True)
    root, venv = home / "src", home / "venv"
    stamp = venv / ".installed"
    with open(CACHE / f"{commit}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test run may be building it right now
        if not _checked_out(root, commit):
            shutil.rmtree(root, ignore_errors=True)  # what an interrupted checkout left
            # --force: a checkout deleted by hand (make clean) is still registered.
            _git("worktree", "add", "--detach", "--force", str(root), commit)
        if not stamp.exists() or stamp.read_text() != commit:
            _install(root, venv)
            stamp.write_text(commit)
    return Release(commit, root, venv, time.monotonic() - started)


def _checked_out(root: Path, commit: str) -> bool:
    if not (root / ".git").exists():
        return False
    done = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    clean = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True, text=True,
    )  # fmt: skip
    return done.returncode == 0 and done.stdout.strip() == commit and not clean.stdout.strip()


def _install(root: Path, venv: Path) -> None:
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps"]
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        # The image's way (deploy/Dockerfile): the pinned closure, then the release itself.
        [*pip, "-r", str(root / "deploy" / "requirements.lock")],
        [*pip, str(root)],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(step)} failed:\n{done.stdout}\n{done.stderr}")
