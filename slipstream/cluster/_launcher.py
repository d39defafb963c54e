"""Running one launcher per node: their output streamed, the first failure failing the job, and
every rank stopped (SIGTERM, then SIGKILL) before the call returns, with the build locks of
ranks stopped half-way removed, and torch.distributed.run's log directory removed. Used by
``emulated.launch`` and ``EmulatedCluster.launch``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from typing import Mapping, Sequence

from . import _netns
from ._forkrun import BOOTSTRAP

__all__ = ["LaunchError"]


class LaunchError(RuntimeError):
    """A node's launcher failed or timed out; the message holds its last lines of output."""


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through ``with`` blocks, then atexit


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _unwind_on_termination() -> dict:
    """Make SIGTERM and SIGHUP raise ``SystemExit`` where they would still kill this process
    outright (main thread, default handler), and SIGINT raise ``KeyboardInterrupt`` where it is
    ignored: a job started in the background by a script inherits SIGINT ignored, and a
    ``kill -INT`` would then leave its ranks running to the end (torchrun, too, handles SIGINT
    whatever it inherited). Returns the handlers to put back."""
    saved = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                saved[sig] = signal.signal(sig, _exit_on_signal)
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            saved[signal.SIGINT] = signal.signal(signal.SIGINT, _interrupt)
    return saved


def _restore_handlers(saved: dict) -> None:
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _stream(proc: subprocess.Popen, prefix: str, tail: deque) -> None:
    for line in proc.stdout:  # type: ignore[union-attr]
        tail.append(line)
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


def _run_nodes(commands: Sequence[tuple[list[str], Mapping[str, str]]], timeout: float | None) -> None:
    """Start one launcher per node, stream their output, fail fast on the first failure.
    SIGINT, SIGTERM and SIGHUP stop every rank (SIGTERM, then SIGKILL after 5 s) before this
    returns: while the ranks run, SIGTERM and SIGHUP (a scheduler stopping the job) unwind like
    Ctrl-C into the cleanup (the launchers run in sessions of their own, which a signal to this
    process does not reach)."""
    saved = _unwind_on_termination()
    logs = tempfile.mkdtemp(prefix=f"slipstream-launch-{os.getpid()}-")
    try:
        _run_and_reap([(_with_log_dir(argv, logs), env) for argv, env in commands], timeout)
    finally:
        shutil.rmtree(logs, ignore_errors=True)
        _restore_handlers(saved)


def _with_log_dir(argv: Sequence[str], logs: str) -> list[str]:
    """``argv`` with torch.distributed.run's per-rank error files in ``logs`` (also given to a
    forking launcher, for where it becomes torch.distributed.run): left to itself, each
    launcher makes a ``torchelastic_*`` directory in the temporary directory and never removes it."""
    marks = [m for m in ("torch.distributed.run", BOOTSTRAP) if m in argv]
    if not marks:
        return list(argv)
    at = list(argv).index(marks[0]) + 1
    return [*argv[:at], "--log-dir", logs, *argv[at:]]


def _run_and_reap(commands: Sequence[tuple[list[str], Mapping[str, str]]], timeout: float | None) -> None:
    procs, tails, readers = [], [], []
    ranks: set[int] = set()  # every process seen below the launchers: whose build locks to clear
    deadline = None if timeout is None else time.monotonic() + timeout
    succeeded = False
    try:
        for i, (argv, env) in enumerate(commands):
            proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace",
                                    start_new_session=True)
            procs.append(proc)
            tails.append(deque(maxlen=40))
            prefix = f"[node {i}] " if len(commands) > 1 else ""
            readers.append(threading.Thread(target=_stream, args=(proc, prefix, tails[-1]), daemon=True))
            readers[-1].start()
        next_look = 0.0
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                report = _tails(tails, range(len(procs)))  # before the kill adds its noise
                raise LaunchError(f"launch timed out after {timeout} s; killed every node\n{report}")
            if time.monotonic() > next_look:  # a rank that dies early still held its pid here
                ranks.update(p for proc in procs for p in _netns.descendants(proc.pid))
                next_look = time.monotonic() + 1.0
            time.sleep(0.05)
        if failed:
            for i in failed:
                readers[i].join(timeout=5)
            nodes = ", ".join(f"node {i} (exit code {codes[i]})" for i in failed)
            raise LaunchError(f"{nodes} failed; killed the other nodes\n" + _tails(tails, failed))
        succeeded = True
    finally:
        ranks.update(_netns.kill_process_trees(procs))
        for r in readers:
            r.join(timeout=5)
        if not succeeded:  # ranks that exit 0 released their locks
            _clear_build_locks(ranks, [{**os.environ, **env} for _, env in commands])


def _clear_build_locks(ranks: set[int], environs: Sequence[Mapping[str, str]]) -> None:
    """Remove the torch extension build locks our stopped ranks held (one killed while it
    built or checked DeepSpeed's op): the next job would meet them."""
    from ..plugins.deepspeed.build_lock import remove_locks_of

    try:
        for path in remove_locks_of(ranks, environs):
            sys.stderr.write(f"slipstream: removed the build lock {path} of a stopped rank\n")
    except (OSError, ImportError) as e:  # never hide why the job stopped
        sys.stderr.write(f"slipstream: could not look for the stopped ranks' build locks: {e}\n")


def _tails(tails: Sequence[deque], nodes: Sequence[int]) -> str:
    return "\n".join(f"--- last lines of node {i} ---\n{''.join(tails[i])}" for i in nodes)
