"""The core's timeline: which part of the communication a caller's computing hid, from the
core's own timestamps (never from wall-clock thresholds)."""

import threading

import torch

from _dist import run_ranks
from slipstream.core_comm import CommConfig, Communicator, counters
from slipstream.core_comm.counters import Timeline


def test_hidden_time_is_flight_time_outside_every_blocked_interval():
    t = Timeline()
    t.flight(0.0, 4.0)
    t.flight(1.0, 2.0)  # nested: counted once
    t.blocked(3.0, 5.0)  # a wait that ends after the call (the caller woke late)
    t.flight(10.0, 11.0)
    assert t.take() == {"comm_s": 5.0, "exposed_s": 2.0, "hidden_s": 4.0, "calls": 3}
    assert t.take() == {"comm_s": 0.0, "exposed_s": 0.0, "hidden_s": 0.0, "calls": 0}


def test_a_timeline_never_taken_stays_bounded_and_its_totals_survive_the_folds(monkeypatch):
    monkeypatch.setattr(Timeline, "FOLD_AT", 10)
    t = Timeline()
    for i in range(100):  # 100 calls of 0.5 s, each waited for in its last 0.25 s
        t.flight(float(i), i + 0.5)
        t.blocked(i + 0.25, i + 0.5)
        assert t.held() < 10
    got = t.take()
    assert (got["comm_s"], got["exposed_s"], got["calls"]) == (50.0, 25.0, 100)
    assert got["hidden_s"] == 25.0  # every fold falls between two calls here
    assert t.take() == {"comm_s": 0.0, "exposed_s": 0.0, "hidden_s": 0.0, "calls": 0}


def test_a_timeline_holds_its_intervals_in_16_bytes_each_and_folds_them_by_its_bound():
    """A job that never takes (a soak of 20,000 calls) kept every interval as a tuple of two
    floats, about 110 bytes: 4 MiB by its end, growing with every call."""
    import tracemalloc

    t = Timeline()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(Timeline.FOLD_AT // 2 - 1):  # held, not folded yet
            t.flight(float(i), i + 0.5)
            t.blocked(i + 0.25, i + 0.5)
        held = tracemalloc.get_traced_memory()[0] - before
        assert t.held() == Timeline.FOLD_AT - 2 and held < 24 * t.held(), held  # 16 bytes, and the arrays' spare room
        for i in range(10 * Timeline.FOLD_AT):
            t.flight(float(i), i + 0.5)
        assert t.held() < Timeline.FOLD_AT and tracemalloc.get_traced_memory()[0] - before < 24 * Timeline.FOLD_AT
    finally:
        tracemalloc.stop()
    assert t.take()["calls"] == Timeline.FOLD_AT // 2 - 1 + 10 * Timeline.FOLD_AT


def test_waits_on_a_communicators_own_thread_block_no_caller():
    t = Timeline()

    def comm_thread():
        counters.mark_comm_thread()
        t.blocked(0.0, 1.0)

    worker = threading.Thread(target=comm_thread)
    worker.start()
    worker.join()
    t.flight(0.0, 1.0)
    assert t.take()["exposed_s"] == 0.0


def _compute_while_in_flight(rank, world):
    comm = Communicator(None, config=CommConfig(timeout_s=60))
    try:
        x, a = torch.ones(1 << 22), torch.randn(256, 256)
        seen = {}
        for mode in ("blocking", "async"):
            counters.timeline.take()
            work = comm.all_reduce(x, async_op=mode == "async")
            for _ in range(50):  # the caller computes meanwhile
                a = torch.tanh(a @ a)
            if work is not None:
                work.wait()
            seen[mode] = counters.timeline.take()
        assert torch.equal(x, torch.full_like(x, world ** 2)), "two all-reduces of ones"
        return seen
    finally:
        comm.close()


def test_an_async_collective_is_in_flight_while_the_caller_computes_and_a_blocking_one_never_is():
    for seen in run_ranks(_compute_while_in_flight, 2, timeout=120):
        assert seen["blocking"]["hidden_s"] == 0.0 and seen["blocking"]["exposed_s"] > 0
        assert seen["async"]["hidden_s"] > 0, seen["async"]
        assert seen["async"]["calls"] == seen["blocking"]["calls"] == 1
