"""Torch extension build locks that cannot hang a job (docs/deepspeed.md, "A stale build lock").

torch builds a JIT extension (DeepSpeed's shm op, loaded by every DeepSpeed job) under
``<build directory>/lock`` (``torch.utils.file_baton.FileBaton``); every other process waits
while the file exists, forever and in silence, so a process killed while it holds the lock
hangs every later job on the machine. ``install`` patches the baton (``uninstall`` undoes it):

- ``try_acquire`` marks the lock it created (``Mark``; torch ignores the content). A marked
  lock whose process is gone is removed and acquired again: the job builds the op (ninja finds
  it up to date) or loads it.
- ``wait`` is bounded (``LockPolicy``, the rules in ``judge``). A stale unmarked lock is never
  removed (nothing slipstream did not create is deleted): the built op is loaded with a
  warning or, not built, the job fails naming the lock and how to clear it.

``remove_locks_of(pids)`` is a launcher's cleanup of its gone ranks' locks.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import functools
import glob
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Collection, Mapping

from ..._common.patch import patch, unpatch
from ..._common.record import warn_once

__all__ = ["LockPolicy", "Mark", "Verdict", "install", "judge", "lock_files", "remove_locks_of", "uninstall"]

log = logging.getLogger("slipstream.deepspeed")

WAIT_VAR = "SLIPSTREAM_BUILD_LOCK_WAIT_S"
_TELL_AFTER_S = 5.0  # a rank waiting on another's up-to-date check (~1 s) stays quiet


@dataclass(kw_only=True, frozen=True)
class LockPolicy:
    """How long a job waits on a build lock."""

    max_wait_s: float = 900.0
    """Longest wait on a lock that looks live; a build of the shm op took 85-92 s on 2 cores."""
    quiet_s: float = 10.0
    """An unmarked lock is stale once no process works in its directory and nothing there
    changed for this long (a compile writes its object file when it ends)."""
    poll_s: float = 0.5
    """Between two looks at the lock."""

    def __post_init__(self) -> None:
        for name in ("max_wait_s", "quiet_s", "poll_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "LockPolicy":
        raw = environ.get(WAIT_VAR)
        if raw is None:
            return cls()
        try:
            return cls(max_wait_s=float(raw))
        except ValueError:
            raise ValueError(f"{WAIT_VAR}={raw!r}: expected a positive number of seconds") from None


@dataclass(frozen=True)
class Mark:
    """What ``try_acquire`` writes into the lock it created."""

    pid: int
    start: int
    """The process's start time, clock ticks after boot (``/proc/<pid>/stat`` field 22)."""
    host: str

    def text(self) -> str:
        return f"slipstream pid={self.pid} start={self.start} host={self.host}\n"

    @classmethod
    def parse(cls, text: str) -> "Mark | None":
        words = text.split()
        if not words or words[0] != "slipstream":
            return None
        fields = dict(w.split("=", 1) for w in words[1:] if "=" in w)
        try:
            return cls(int(fields["pid"]), int(fields["start"]), fields["host"])
        except (KeyError, ValueError):
            return None

    @classmethod
    def of_process(cls, pid: int) -> "Mark | None":
        """The mark process ``pid`` of this host would write; None when it is gone."""
        start = _start_time(pid)
        return None if start is None else cls(pid, start, socket.gethostname())

    def holder_alive(self) -> bool:
        """Whether the marking process still runs (a zombie or a reused pid does not count)."""
        return _start_time(self.pid) == self.start


class Verdict(enum.Enum):
    WAIT = "live: wait"
    REMOVE = "stale, made under slipstream: remove it"
    LOAD = "stale, not ours, the op is built: load it"
    FAIL = "stale, not ours, the op is not built: fail naming the lock"


def judge(mark: Mark | None, *, host: str, holder_alive: bool, busy: bool, quiet_for: float,
          built: bool, quiet_s: float) -> Verdict:
    """The staleness rules, as a pure function of what was seen. A mark from another host
    (a shared home directory) names a process this machine cannot see: judged as unmarked."""
    if mark is not None and mark.host == host:
        return Verdict.WAIT if holder_alive else Verdict.REMOVE
    if busy or quiet_for < quiet_s:
        return Verdict.WAIT
    return Verdict.LOAD if built else Verdict.FAIL


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _read_mark(path: str) -> Mark | None:
    try:
        with open(path, errors="replace") as f:
            return Mark.parse(f.read(200))
    except OSError:
        return None


def _busy(directory: str) -> bool:
    """Whether a process has its working directory in ``directory`` (ninja and the compilers
    it starts run there). Processes of other users cannot be seen: their build still shows
    as changes in the directory."""
    real = os.path.realpath(directory)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if cwd == real or cwd.startswith(real + os.sep):
            return True
    return False


def _last_change(directory: str) -> float:
    """The newest modification time of the directory and its entries (wall clock)."""
    times = []
    with contextlib.suppress(OSError):
        times.append(os.stat(directory).st_mtime)
        with os.scandir(directory) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):  # removed meanwhile
                    times.append(entry.stat(follow_symlinks=False).st_mtime)
    return max(times, default=0.0)


def _library(directory: str) -> str:
    """The op torch loads after waiting: ``<build directory>/<name>.so``."""
    return os.path.join(directory, os.path.basename(os.path.normpath(directory)) + ".so")


def _remove_if_stale(path: str, *, warn: bool = False) -> bool:
    """Remove ``path`` if it is marked by a process of this host that is gone (with a warning
    when ``warn``); False when not removed. Under a flock of the directory, so that two processes
    that both saw the stale lock cannot remove the fresh one the first of them made after
    removing it."""
    try:
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    except OSError:
        return False
    try:
        if not _flock(fd, timeout=5.0):
            return False
        mark = _read_mark(path)
        if mark is None or mark.host != socket.gethostname() or mark.holder_alive():
            return False
        os.remove(path)
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)  # releases the flock
    if warn:
        warn_once(f"removed the stale torch extension build lock {path}: the process that made it is gone")
    return True


def _flock(fd: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)


def try_acquire(baton, original) -> bool:
    """``FileBaton.try_acquire``, marking the lock it makes and replacing a stale marked one."""
    path = baton.lock_file_path
    if not (original(baton) or (_remove_if_stale(path, warn=True) and original(baton))):
        return False
    mark = Mark.of_process(os.getpid())
    try:
        f = open(path, "r+")  # never created here: only into the lock this process made
    except OSError:
        return True
    with f:
        f.write(mark.text() if mark is not None else "")
    return True


def wait(baton, policy: LockPolicy | None = None) -> None:
    """``FileBaton.wait``, bounded: returns when the lock is gone or may be ignored, raises a
    ``RuntimeError`` naming the lock when it cannot be."""
    policy = policy or LockPolicy.from_env()
    path = baton.lock_file_path
    directory = os.path.dirname(path)
    started, told = time.monotonic(), False
    while os.path.exists(path):
        mark = _read_mark(path)
        alive = mark is not None and mark.holder_alive()
        busy, quiet_for = _busy(directory), time.time() - _last_change(directory)
        built = os.path.exists(_library(directory))
        verdict = judge(mark, host=socket.gethostname(), holder_alive=alive, busy=busy, quiet_for=quiet_for,
                        built=built, quiet_s=policy.quiet_s)
        if verdict is Verdict.LOAD:
            warn_once(f"the torch extension build lock {path} is stale (no process works in its directory, "
                      f"nothing changed there for {quiet_for:.0f} s); the built op is loaded. "
                      f"Remove it when no build is running: rm {path}")
            return
        if verdict is Verdict.FAIL:
            raise RuntimeError(f"the torch extension build lock {path} is stale and the op it guards is not "
                               f"built ({_library(directory)} is missing): a build killed before it "
                               f"finished left it. If no build is running on this machine: rm {path}")
        if verdict is Verdict.REMOVE and _remove_if_stale(path, warn=True):
            if not built:  # torch only loads after a wait: nothing to load
                raise RuntimeError(f"process {mark.pid} died while it built the torch extension in "
                                   f"{directory}; slipstream removed its lock {path}. Run the job again to build it.")
            return
        why = (f"held by process {mark.pid}" if alive else "a process works in its directory" if busy
               else f"its directory changed {quiet_for:.0f} s ago")
        waited = time.monotonic() - started
        if waited > policy.max_wait_s:
            raise RuntimeError(f"waited {policy.max_wait_s:.0f} s for the torch extension build lock {path}, "
                               f"still live ({why}). If no build is running: rm {path}; "
                               f"{WAIT_VAR} sets how long to wait.")
        if not told and waited > _TELL_AFTER_S:
            log.warning("slipstream: waiting for the torch extension build lock %s (%s), at most %.0f s",
                        path, why, policy.max_wait_s)
            told = True
        time.sleep(policy.poll_s)


def install() -> None:
    """Patch torch's ``FileBaton``. Idempotent; ``uninstall`` undoes it."""
    from torch.utils.file_baton import FileBaton

    acquire = FileBaton.try_acquire
    patch(FileBaton, "try_acquire", functools.wraps(acquire)(lambda baton: try_acquire(baton, acquire)),
          owner="deepspeed")
    patch(FileBaton, "wait", functools.wraps(FileBaton.wait)(lambda baton: wait(baton)), owner="deepspeed")


def uninstall() -> None:
    file_baton = sys.modules.get("torch.utils.file_baton")
    if file_baton is not None:
        for name in ("try_acquire", "wait"):
            unpatch(file_baton.FileBaton, name)


def lock_files(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Every torch extension build lock under the extensions root: ``$TORCH_EXTENSIONS_DIR``
    or torch's default root (with its ``py<version>_<accelerator>`` folders)."""
    root = environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    return sorted(glob.glob(os.path.join(root, "*", "lock")) + glob.glob(os.path.join(root, "*", "*", "lock")))


def remove_locks_of(pids: Collection[int], environs: Collection[Mapping[str, str]] = (os.environ,)) -> list[str]:
    """Remove the build locks marked by processes ``pids`` that are gone (a launcher's ranks
    after the job), under the extensions root of each environment; returns the paths removed."""
    paths = {path for environ in environs for path in lock_files(environ)}
    return [path for path in sorted(paths)
            if getattr(_read_mark(path), "pid", None) in pids and _remove_if_stale(path)]
