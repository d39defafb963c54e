"""``slipstream.data.AsyncLoader``: the same batches in the same order, prepared ahead on a
background thread or in a child process; errors raised in the loop with the loader's traceback;
an early stop leaves no thread or process behind."""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import time
import traceback

import pytest
import torch

from slipstream.data import AsyncLoader


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 100, (2, 5), generator=g), "n": i} for i in range(n)]


def _wait(cond, seconds=10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def _loader_threads():
    return [t for t in threading.enumerate() if t.name == "slipstream-async-loader"]


def _loader_processes():
    return [p for p in multiprocessing.active_children() if p.name == "slipstream-async-loader"]


def _pid_of(b):
    return {**b, "pid": os.getpid()}


def test_same_batches_in_order_with_the_transform_run_on_the_background_thread():
    source = _batches(7)
    where = []

    def transform(b):
        where.append(threading.current_thread().name)
        return {**b, "double": b["input_ids"] * 2}

    loader = AsyncLoader(source, "cpu", transform=transform)
    assert len(loader) == 7
    got = list(loader)
    assert [b["n"] for b in got] == list(range(7))
    for b, s in zip(got, source):
        assert torch.equal(b["input_ids"], s["input_ids"]) and torch.equal(b["double"], s["input_ids"] * 2)
    assert set(where) == {"slipstream-async-loader"}
    assert _wait(lambda: not _loader_threads())


def test_a_process_gives_the_same_batches_in_order_collated_and_transformed_in_the_child():
    source = _batches(7)
    collated_in = []

    def collating():  # as a DataLoader's iterator: the batch is built when asked for
        for b in source:
            yield {**b, "collated_in": os.getpid()}

    loader = AsyncLoader(collating(), "cpu", transform=_pid_of, process=True, prefetch=3)
    got = list(loader)
    assert [b["n"] for b in got] == list(range(7))
    for b, s in zip(got, source):
        assert torch.equal(b["input_ids"], s["input_ids"])
        collated_in.append(b["collated_in"])
        assert b["pid"] == b["collated_in"]  # the transform ran where the batch was collated
    assert len(set(collated_in)) == 1 and collated_in[0] != os.getpid()
    assert _wait(lambda: not _loader_threads() and not _loader_processes())


def test_a_dead_loader_process_is_named_in_the_loop():
    def dying():
        yield 0
        os._exit(3)

    with pytest.raises(RuntimeError, match=r"its process exited \(code 3\)"):
        list(AsyncLoader(dying(), process=True))
    assert _wait(lambda: not _loader_threads() and not _loader_processes())


def test_leaving_a_process_loop_early_stops_the_child():
    def endless():
        i = 0
        while True:
            yield torch.tensor([i])
            i += 1

    for b in AsyncLoader(endless(), prefetch=2, process=True):
        if int(b) == 3:
            break
    gc.collect()
    assert _wait(lambda: not _loader_threads() and not _loader_processes()), "the loader outlived the loop"


def test_the_next_batch_is_prepared_while_the_step_runs():
    prepared = {i: threading.Event() for i in range(4)}

    def source():
        for i in range(4):
            yield torch.full((3,), i)
            prepared[i].set()  # the generator resumes (prepares batch i+1) only after handing over i

    it = iter(AsyncLoader(source()))
    first = next(it)
    # a plain loop would not touch the loader again until the next next(): here it already has
    assert prepared[1].wait(timeout=10), "batch 1 was not prepared ahead of the step"
    assert torch.equal(first, torch.zeros(3)) and [int(b[0]) for b in it] == [1, 2, 3]


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_an_error_in_the_loader_is_raised_in_the_loop_with_the_loaders_traceback(process):
    def failing_collate():
        for i in range(5):
            if i == 2:
                raise ValueError("record 2 is malformed")
            yield i

    seen = []
    with pytest.raises(ValueError, match="record 2 is malformed") as err:
        for b in AsyncLoader(failing_collate(), process=process):
            seen.append(b)
    assert seen == [0, 1]
    if process:  # the child's traceback, as text, is the cause
        assert "failing_collate" in str(err.value.__cause__), err.value.__cause__
    else:
        frames = [f.name for f in traceback.extract_tb(err.value.__traceback__)]
        assert "failing_collate" in frames, frames
    assert _wait(lambda: not _loader_threads() and not _loader_processes())


def test_leaving_the_loop_early_stops_the_thread_and_the_loader():
    produced = []

    def endless():
        i = 0
        while True:
            produced.append(i)
            yield torch.tensor([i])
            i += 1

    for b in AsyncLoader(endless(), prefetch=2):
        if int(b) == 3:
            break
    gc.collect()
    assert _wait(lambda: not _loader_threads()), "the loader thread outlived the loop"
    # at most: the 4 consumed, 2 queued, one in the thread's hands, one it started before stopping
    assert len(produced) <= 4 + 2 + 2, produced


def test_close_stops_a_loader_that_is_ahead_and_bad_settings_are_refused():
    it = iter(AsyncLoader(range(1000), prefetch=3))
    assert next(it) == 0
    it.close()
    assert not _loader_threads()
    with pytest.raises(StopIteration):
        next(it)
    with pytest.raises(ValueError, match="prefetch must be >= 1"):
        AsyncLoader([], prefetch=0)
    with pytest.raises(TypeError, match="transform must be callable"):
        AsyncLoader([], transform=3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batches_arrive_on_the_cuda_device_equal_to_the_source():
    source = _batches(5)
    got = list(AsyncLoader(source, "cuda"))
    for b, s in zip(got, source):
        assert b["input_ids"].is_cuda and torch.equal(b["input_ids"].cpu(), s["input_ids"]) and b["n"] == s["n"]


def test_bench_loader_runs_the_three_loops_on_the_same_batches(tmp_path):
    """The bench end to end (tiny): the plain, thread and process loops get the same batches in the same order (each
    batch's sum, compared by the bench); the figure itself is a measurement, reported, not asserted."""
    import json

    from slipstream.cli import main

    out = tmp_path / "loader.json"
    assert main(["bench", "loader", "--steps", "4", "--step-ms", "2", "--collate-ms", "1", "--repeats", "2",
                 "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert len(record["rounds"]) == 2 and all(r["collate_s"] > 0 for r in record["rounds"])
    assert all(r["process_s"] > 0 for r in record["rounds"]) and "hidden_process_median" in record
    assert all(r["same_batches"] for r in record["rounds"])  # each loop got the plain loop's batches, in order
    assert not _loader_threads() and not _loader_processes()
