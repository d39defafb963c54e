"""Which path each collective took: per-process counts that tests, ``--json`` outputs and a
user's status read, and a ``torch.profiler`` range per call.

Every call that reaches slipstream (the backend, the DDP hook, an adapter's stand-in) is
counted once under ``(collective, path)``, ``path`` being the algorithm that ran it (``shm``,
``cma``, ``hierarchical``, ``staged``, ``local``) or ``stock`` (the group's own backend)::

    counters.snapshot()   # {"all_reduce": {"shm": {"calls": 12, "bytes": 50331648}, "stock": {...}}}

While a profiler records, each call is also a range named like the stock backends' own
(``gloo:all_reduce``): ``slipstream:all_reduce:shm``. Outside one no range is entered (a
``record_function`` costs a few microseconds, as much as a small allreduce's wait).
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict

import torch

__all__ = ["PathCounts", "count", "record", "reset", "snapshot"]


class PathCounts:
    """Calls and bytes per (collective, path). Thread-safe: async calls count on the caller."""

    __slots__ = ("_calls", "_bytes", "_lock")

    def __init__(self) -> None:
        self._calls: dict = defaultdict(int)
        self._bytes: dict = defaultdict(int)
        self._lock = threading.Lock()

    def add(self, kind: str, path: str, nbytes: int) -> None:
        with self._lock:
            self._calls[kind, path] += 1
            self._bytes[kind, path] += nbytes

    def snapshot(self) -> dict:
        """``{collective: {path: {"calls": n, "bytes": b}}}``, a copy."""
        out: dict = {}
        with self._lock:
            for (kind, path), calls in sorted(self._calls.items()):
                out.setdefault(kind, {})[path] = {"calls": calls, "bytes": self._bytes[kind, path]}
        return out

    def reset(self) -> None:
        with self._lock:
            self._calls.clear()
            self._bytes.clear()


# One table per process: a path count describes the process's calls, whatever their group.
_COUNTS = PathCounts()
count = _COUNTS.add
snapshot = _COUNTS.snapshot
reset = _COUNTS.reset


def record(kind: str, path: str, nbytes: int):
    """Count the call; a profiler range around it while a profiler records."""
    _COUNTS.add(kind, path, nbytes)
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(f"slipstream:{kind}:{path}")
    return contextlib.nullcontext()
