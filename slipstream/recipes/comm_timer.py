"""Wall time a training stack spends in its collectives, waits on their async handles included:
the recipe's "communication" figures.

The stack's own collective entry points are replaced by :class:`Timed` views (DeepSpeed's
communication backend, FSDP2's comm objects and its ``dist`` module); each call, and each wait
on the handle it returns, adds to a :class:`CommTimer`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import torch.distributed as dist

__all__ = ["CommTimer", "Timed"]


class CommTimer:
    """Seconds in collectives: ``seconds`` since the step loop last zeroed it, ``by_op`` per op
    over the whole run (``op -> [calls, seconds]``)."""

    __slots__ = ("seconds", "by_op")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.by_op: dict[str, list] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds += seconds
        entry = self.by_op.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    def wrap(self, name: str, fn: Callable, wait_name: str | None = None) -> Callable:
        """``fn`` timed as ``name``; a handle it returns is timed as ``wait_name`` (default
        ``name``) when waited on."""
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.add(name, time.perf_counter() - t0)
            return _TimedWork(out, self, wait_name or name) if hasattr(out, "wait") else out

        return timed

    def calls(self) -> dict[str, dict[str, float]]:
        """``{op: {"calls", "seconds"}}`` over the run, by op name."""
        return {op: {"calls": n, "seconds": t} for op, (n, t) in sorted(self.by_op.items())}


class Timed:
    """``target`` with its methods named in ``ops`` (a handle's wait timed as the op's name +
    ``wait_suffix``) and, when ``call`` names an op, its call timed; the rest passed through."""

    def __init__(self, target: Any, timer: CommTimer, *, ops: Iterable[str] = (), call: str | None = None,
                 wait_suffix: str = "") -> None:
        self._target, self._timer, self._ops = target, timer, frozenset(ops)
        self._call, self._suffix = call, wait_suffix

    def __call__(self, *args, **kwargs):
        return self._timer.wrap(self._call, self._target, self._call + self._suffix)(*args, **kwargs)

    def __getattr__(self, name: str):
        attr = getattr(self._target, name)
        return self._timer.wrap(name, attr, name + self._suffix) if name in self._ops else attr


class _TimedWork(dist.Work):
    """An async collective's handle whose ``wait`` is timed; a ``dist.Work``, as FSDP2 wants."""

    def __init__(self, work, timer: CommTimer, name: str) -> None:
        super().__init__()
        self._work, self._timer, self._name = work, timer, name

    def wait(self, timeout=None):
        t0 = time.perf_counter()
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._timer.add(self._name, time.perf_counter() - t0)
        return done

    def __getattr__(self, name: str):
        return getattr(self._work, name)


# The rest of Work's methods are the handle's (the base class's own would answer for an empty Work).
for _method in ("block_current_stream", "exception", "get_future", "get_future_result", "is_completed",
                "is_success", "result", "source_rank", "synchronize"):
    setattr(_TimedWork, _method, lambda self, *a, _m=_method, **k: getattr(self._work, _m)(*a, **k))
