"""The core's one ``Work``: a ``torch.distributed.Work`` that completes from a thread's future,
after a stock collective's handle, or by a finish step on the waiting thread; its torch future
carries the call's result, or fails with the call's error (no process group needed)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from slipstream.core_comm.work import InFlight, Work


def test_a_work_from_a_future_is_a_torch_work_whose_future_holds_the_result():
    done: Future = Future()
    work = Work(done, result=[torch.ones(2)])
    assert isinstance(work, dist.Work) and not work.is_completed()
    with pytest.raises(TimeoutError):
        work.wait(timeout=timedelta(milliseconds=10))
    fut = work.get_future()
    threading.Timer(0.05, done.set_result, (None,)).start()
    assert work.wait() and work.is_success() and work.exception() is None
    assert torch.equal(fut.wait()[0], torch.ones(2))
    assert torch.equal(work.returning(torch.zeros(1)).get_future().wait(), torch.zeros(1))


def test_an_error_reaches_wait_and_fails_the_torch_future():
    done: Future = Future()
    work = Work(done, result="value")
    fut = work.get_future()
    done.set_exception(RuntimeError("peer died"))
    with pytest.raises(RuntimeError, match="peer died"):
        work.wait()
    assert not work.is_success() and isinstance(work.exception(), RuntimeError)
    with pytest.raises(RuntimeError, match="peer died"):
        fut.wait()
    chained = fut.then(lambda f: f.value())  # what a C++ reader such as DDP's reducer sees: a failure
    with pytest.raises(RuntimeError, match="peer died"):
        chained.wait()


def test_after_a_stock_work_runs_the_step_then_completes():
    stock: torch.futures.Future = torch.futures.Future()
    order = []
    work = Work.after(_create_work_from_future(stock), lambda: order.append("then"), result="out")
    assert not work.is_completed() and order == []
    stock.set_result([torch.ones(1)])
    assert work.wait() and order == ["then"] and work.get_future().wait() == "out"
    failing = Work.after(Work.completed(), lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.wait()


class _NoFuture(dist.Work):
    """A stock handle without a future, as gloo's reduce-scatter hands back."""

    def __init__(self, error: BaseException | None = None) -> None:
        super().__init__()
        self.waits, self.error = 0, error

    def wait(self, timeout=None) -> bool:
        self.waits += 1
        if self.error is not None:
            raise self.error
        return True


def test_after_a_stock_work_without_a_future_completes_on_wait():
    stock, order = _NoFuture(), []
    with pytest.raises(RuntimeError, match="not implemented"):
        stock.get_future()
    work = Work.after(stock, lambda: order.append("then"), result="out")
    assert not work.is_completed() and order == [] and stock.waits == 0
    assert work.wait() and work.is_completed() and order == ["then"] and stock.waits == 1
    assert work.get_future().wait() == "out" and work.wait() and stock.waits == 1  # the step runs once
    failed = Work.after(_NoFuture(RuntimeError("peer died")), lambda: order.append("never"))
    with pytest.raises(RuntimeError, match="peer died"):
        failed.wait()
    assert order == ["then"]


def test_a_finish_step_runs_once_on_the_waiting_thread_and_keeps_its_error():
    calls = []
    work = Work(finish=lambda: calls.append(threading.current_thread().name))
    assert not work.is_completed()
    work.wait()
    work.wait()
    assert calls == [threading.current_thread().name] and work.is_completed()
    broken = Work(finish=lambda: 1 / 0)
    for _ in range(2):
        with pytest.raises(ZeroDivisionError):
            broken.wait()
    with pytest.raises(ValueError, match="one of the two"):
        Work()


def test_the_in_flight_queue_finishes_calls_in_order_and_holds_at_most_its_depth():
    finished, futures = [], [Future() for _ in range(4)]
    queue = InFlight(depth=2)
    for i, future in enumerate(futures[:2]):
        queue.push(f"call {i}", [Work(future), None], lambda i=i: finished.append(i))
    assert len(queue) == 2 and not queue.oldest_done() and finished == []
    futures[0].set_result(None)
    assert queue.oldest_done()
    futures[1].set_result(None)
    queue.push("call 2", [Work(futures[2])], lambda: finished.append(2))  # past the depth: call 0 finished now
    assert finished == [0] and len(queue) == 2
    futures[2].set_result(None)
    queue.drain()
    assert finished == [0, 1, 2] and len(queue) == 0 and not queue.oldest_done()
    with pytest.raises(ValueError, match="depth 0"):
        InFlight(depth=0)


def test_an_in_flight_failure_waits_for_every_call_finishes_none_and_names_its_call():
    finished, later = [], Future()
    queue = InFlight()
    queue.push("first", [Work.completed()], lambda: finished.append("first"))
    failed: Future = Future()
    failed.set_exception(RuntimeError("peer 3 is gone"))
    queue.push("ZeRO-3 reduce-scatter of a bucket", [Work(failed)], lambda: finished.append("failed"))
    queue.push("last", [Work(later)], lambda: finished.append("last"))
    threading.Timer(0.1, later.set_result, (None,)).start()
    with pytest.raises(RuntimeError, match="peer 3 is gone") as raised:
        queue.drain()
    assert finished == ["first"] and len(queue) == 0
    assert later.done(), "a call still in flight was left running"
    assert any("in-flight ZeRO-3 reduce-scatter of a bucket" in note for note in raised.value.__notes__)
