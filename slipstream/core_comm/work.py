"""``Work``: the one handle of the core's asynchronous calls.

A ``torch.distributed.Work``, so torch and the stacks wait on it as on gloo's own (DDP's
reducer takes its ``get_future()``, FSDP2's prefetch calls ``wait()``). It completes from a
``concurrent.futures.Future`` that a thread completes (the communicator's worker, the TCP
transport's lanes), a stock collective's ``dist.Work`` (``Work.after``), or a ``finish`` step
run on the first ``wait()``, on the waiting thread (the hierarchical pipeline's inter-node
exchanges, whose reduction runs where the pipeline waits for them; stock handles of device
tensors). ``get_future()``'s value is the call's ``result`` (the output tensors, for the
backend; the bucket, for DDP).

A stock handle of device tensors (NCCL's) is never turned into a future completed from its
own: NCCL completes its future when the kernel is queued, and only its ``wait()`` makes the
waiting stream wait for the data. Where an entry point hands a call to the stock backend it
returns the stock ``Work`` itself; where the core must wrap one (a copy-back after it, several
in one), the wrapper completes through the stock ``wait()`` on the waiting thread.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import counters

__all__ = ["InFlight", "Work"]


def _has_future(work: dist.Work) -> bool:
    try:
        work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented" (gloo's reduce-scatter, among others)
        return False
    return True


class Work(dist.Work):
    """Handle of one asynchronous call; see the module docstring."""

    def __init__(self, future: Future | None = None, *, finish: Callable[[], Any] | None = None,
                 result: Any = None) -> None:
        super().__init__()
        if (future is None) == (finish is None):
            raise ValueError("a Work completes from a future or from a finish step, one of the two")
        self._future = future
        self._finish = finish
        self._result = result
        self._lock = threading.Lock() if finish is not None else None

    @classmethod
    def completed(cls, result: Any = None) -> "Work":
        future: Future = Future()
        future.set_result(None)
        return cls(future, result=result)

    @classmethod
    def after(cls, work, then: Callable[[], Any] | None = None, *, result: Any = None,
              on_wait: bool = False) -> "Work":
        """Completes once ``work`` (a ``Work`` or a stock collective's ``dist.Work``) has, and
        ``then()`` has run after it; an error of either is this Work's error. ``on_wait``: it
        completes on the first ``wait()`` instead, by ``work``'s own ``wait()`` on the waiting
        thread, then ``then()``: what a stock handle of device tensors needs, whose future
        completes when the collective is queued on the device (NCCL's), and whose ``wait()``
        is what makes the waiter's stream wait for the data. So too for a stock handle without
        a future (gloo's reduce-scatter), and after a Work that itself completes on ``wait()``."""
        if on_wait or (isinstance(work, Work) and work._future is None) or (
                not isinstance(work, Work) and not _has_future(work)):
            return cls(finish=lambda: (work.wait(), then is not None and then()), result=result)
        done: Future = Future()

        def finish(outcome: Callable[[], Any]) -> None:
            """``outcome()`` raises ``work``'s error, if any."""
            try:
                outcome()
                if then is not None:
                    then()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                done.set_exception(e)
            else:
                done.set_result(None)

        if isinstance(work, Work):
            work._future.add_done_callback(lambda f: finish(f.result))
        else:
            work.get_future().add_done_callback(lambda fut: finish(fut.wait))
        return cls(done, result=result)

    @classmethod
    def of_stock(cls, works: list, *, result: Any = None) -> "Work":
        """One Work over several stock handles: it completes on the first ``wait()``, by each
        handle's own ``wait()`` in turn on the waiting thread (why: ``after``'s ``on_wait``)."""
        return cls(finish=lambda: [work.wait() for work in works], result=result)

    def returning(self, result: Any) -> "Work":
        """The same completion, with ``result`` as its future's value."""
        if self._future is not None:
            return Work(self._future, result=result)
        return Work(finish=self.wait, result=result)

    def wait(self, timeout=None) -> bool:
        """Block until done and raise the call's error. ``timeout`` (seconds or a timedelta;
        zero or None: none) raises ``TimeoutError`` when it runs out first."""
        started = time.perf_counter()
        try:
            return self._wait(timeout.total_seconds() if isinstance(timeout, timedelta) else timeout)
        finally:
            counters.timeline.blocked(started, time.perf_counter())

    def _wait(self, seconds) -> bool:
        if self._future is not None:
            self._future.result(timeout=seconds or None)
            return True
        with self._lock:
            if self._finish is not None:
                finish, self._finish = self._finish, None
                future: Future = Future()
                try:
                    finish()
                except BaseException as e:  # noqa: BLE001 - kept for every later wait
                    future.set_exception(e)
                else:
                    future.set_result(None)
                self._future = future
        self._future.result()
        return True

    def is_completed(self) -> bool:
        return self._future is not None and self._future.done()

    def is_success(self) -> bool:
        return self.is_completed() and self._future.exception() is None

    def exception(self):
        return self._future.exception() if self.is_completed() else None

    def get_future(self) -> torch.futures.Future:
        """A torch future of ``result``, failed with the call's error."""
        if self._future is None:
            self.wait()
        result: torch.futures.Future = torch.futures.Future()

        def done(cf) -> None:
            error = cf.exception()
            if error is not None:
                result.set_exception(error)
            else:
                result.set_result(self._result)

        self._future.add_done_callback(done)
        # torch's set_exception completes the future *successfully* with the exception object as
        # its value (only Python's value() re-raises it; C++ readers such as DDP's reducer take it
        # for a tensor). Re-raising inside a callback marks the chained future failed for all.
        return result.then(lambda fut: fut.value())


class InFlight:
    """Calls issued and not yet finished, oldest first: the one queue of reductions in flight
    that the stacks' overlaps keep (ZeRO-1/2 and ZeRO-3 buckets, FSDP2's reductions).

    Each entry is a call's name, its handles and what finishing it takes once they are done
    (the stack's bookkeeping). At most ``depth`` entries stay in flight (None: no bound): a
    push beyond it finishes the oldest first. One failure rule: a handle's error waits for
    every call still in flight (none is left running on a buffer the stack reuses), finishes
    none of them, and raises the first error, with a note naming its call."""

    __slots__ = ("depth", "pending")

    def __init__(self, depth: int | None = None) -> None:
        if depth is not None and depth < 1:
            raise ValueError(f"an in-flight queue holds at least one call, got depth {depth}")
        self.depth = depth
        self.pending: list[tuple[str, list, Callable[[], Any] | None]] = []

    def __len__(self) -> int:
        return len(self.pending)

    def push(self, name: str, works: list, finish: Callable[[], Any] | None = None) -> None:
        """Keep ``name``'s ``works`` (its handles; None entries are calls made synchronously)
        until it is finished; beyond ``depth`` calls, the oldest is finished now."""
        self.pending.append((name, [w for w in works if w is not None], finish))
        while self.depth is not None and len(self.pending) > self.depth:
            self.pop()

    def oldest_done(self) -> bool:
        """Whether the oldest call's handles have all completed (False when none is in flight)."""
        return bool(self.pending) and all(w.is_completed() for w in self.pending[0][1])

    def pop(self) -> None:
        """Wait for the oldest call and finish it (the failure rule above on an error)."""
        name, works, finish = self.pending.pop(0)
        try:
            for work in works:
                work.wait()
        except Exception as e:  # noqa: BLE001 - raised below, after the others
            self._fail(name, e)
        if finish is not None:
            finish()

    def drain(self) -> None:
        """Wait for and finish every call in flight, in order."""
        while self.pending:
            self.pop()

    def _fail(self, name: str, error: Exception):
        """Wait for every call left, drop them, and raise ``error`` naming ``name``."""
        left, self.pending = self.pending, []
        for _, works, _ in left:
            for work in works:
                try:
                    work.wait()
                except Exception:  # noqa: BLE001 - the first error is the one raised
                    pass
        error.add_note(f"slipstream: raised by the in-flight {name} (and {len(left)} later call(s) "
                       "waited for, not finished)")
        raise error
