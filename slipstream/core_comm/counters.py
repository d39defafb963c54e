"""Which path each collective took: per-process counts that tests, ``--json`` outputs and a
user's status read, and a ``torch.profiler`` range per call.

Every call that reaches slipstream (the backend, the DDP hook, an adapter's stand-in) is
counted once under ``(collective, path)``, ``path`` being the algorithm that ran it (``shm``,
``cma``, ``hierarchical``, ``staged``, ``local``) or ``stock`` (the group's own backend)::

    counters.snapshot()   # {"all_reduce": {"shm": {"calls": 12, "bytes": 50331648}, "stock": {...}}}

While a profiler records, each call is also a range named like the stock backends' own
(``gloo:all_reduce``): ``slipstream:all_reduce:shm``. Outside one no range is entered (a
``record_function`` costs a few microseconds, as much as a small allreduce's wait).

``timeline`` keeps when each collective was in flight and when a caller was blocked on one,
so that a step can say how much of its communication computing hid (``timeline.take()``);
``link_bytes()`` is what this rank sent across the node link.
"""

from __future__ import annotations

import contextlib
import threading
from array import array
from collections import defaultdict

import torch

__all__ = ["PathCounts", "Timeline", "count", "link_bytes", "mark_comm_thread", "record", "reset", "snapshot",
           "timeline"]


class PathCounts:
    """Calls and bytes per (collective, path). Thread-safe: async calls count on the caller."""

    __slots__ = ("_calls", "_bytes", "_link", "_lock")

    def __init__(self) -> None:
        self._calls: dict = defaultdict(int)
        self._bytes: dict = defaultdict(int)
        self._link = 0  # bytes this rank sent to other nodes
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

    def add_link(self, nbytes: int) -> None:
        with self._lock:
            self._link += nbytes

    def link_bytes(self) -> int:
        return self._link

    def reset(self) -> None:
        with self._lock:
            self._calls.clear()
            self._bytes.clear()
            self._link = 0
        timeline.take()


class Timeline:
    """When collectives were in flight and when a caller's thread was blocked on one
    (``time.perf_counter`` seconds). A synchronous call is blocked for all of its flight, an
    asynchronous one only inside ``Work.wait``; waits on the communicators' own threads are
    not a caller's. Intervals are merged, so nested records count once. Memory stays bounded
    in a job that never takes: the intervals are kept as pairs of doubles (16 bytes each, where
    a tuple of two floats took about 110), and past ``FOLD_AT`` of them they are folded into
    running totals (an overlap that straddles a fold is counted on both sides of it): at most
    about 260 KiB. A soak of 20,000 calls that never took grew 4 MiB before."""

    __slots__ = ("_flights", "_blocked", "_folded", "_lock")
    FOLD_AT = 1 << 14

    def __init__(self) -> None:
        self._flights = array("d")  # start, end, start, end, ...
        self._blocked = array("d")
        self._folded = _measure(array("d"), array("d"))
        self._lock = threading.Lock()

    def held(self) -> int:
        """The intervals held, not yet folded (a method, not ``len``: an empty timeline stays
        truthy)."""
        return (len(self._flights) + len(self._blocked)) // 2

    def flight(self, start: float, end: float) -> None:
        with self._lock:
            self._flights.extend((start, end))
            self._fold_if_full()

    def blocked(self, start: float, end: float) -> None:
        if not getattr(_THREAD, "comm", False):
            with self._lock:
                self._blocked.extend((start, end))
                self._fold_if_full()

    def _fold_if_full(self) -> None:
        if self.held() >= self.FOLD_AT:
            measured = _measure(self._flights, self._blocked)
            self._folded = {k: self._folded[k] + v for k, v in measured.items()}
            self._flights, self._blocked = array("d"), array("d")

    def take(self) -> dict:
        """Since the last take: ``comm_s`` (some collective in flight), ``exposed_s`` (a
        caller blocked on one), ``hidden_s`` (in flight while no caller was blocked) and the
        ``calls``; then forgets them."""
        with self._lock:
            flights, blocked, folded = self._flights, self._blocked, self._folded
            self._flights, self._blocked, self._folded = array("d"), array("d"), _measure(array("d"), array("d"))
        return {k: folded[k] + v for k, v in _measure(flights, blocked).items()}


def _measure(flights: array, blocked: array) -> dict:
    exposed = _covered(blocked)
    return {"comm_s": _covered(flights), "exposed_s": exposed, "hidden_s": _covered(flights + blocked) - exposed,
            "calls": len(flights) // 2}


def _covered(intervals: array) -> float:
    """Length of the union of the intervals ``start, end, start, end, ...``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(zip(intervals[::2], intervals[1::2])):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


_THREAD = threading.local()


def mark_comm_thread() -> None:
    """Mark the calling thread as a communicator's own (its waits block no caller)."""
    _THREAD.comm = True


# One table per process: a path count describes the process's calls, whatever their group.
_COUNTS = PathCounts()
count = _COUNTS.add
snapshot = _COUNTS.snapshot
reset = _COUNTS.reset
link_bytes = _COUNTS.link_bytes
add_link = _COUNTS.add_link
timeline = Timeline()


def record(kind: str, path: str, nbytes: int):
    """Count the call; a profiler range around it while a profiler records."""
    _COUNTS.add(kind, path, nbytes)
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(f"slipstream:{kind}:{path}")
    return contextlib.nullcontext()
