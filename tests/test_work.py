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

from slipstream.core_comm.work import Work


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
