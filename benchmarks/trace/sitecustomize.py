"""A timing probe for one job's ranks, loaded by Python at start-up from ``PYTHONPATH``:
``SS_TRACE_DIR=<folder> PYTHONPATH=benchmarks/trace slipstream finetune ...``.

In every process that has a ``RANK`` it appends one JSON line per event to
``<folder>/rank<R>-<pid>.jsonl``: each reduce-scatter and all-gather the core is given (``issue``,
on the caller's thread) and runs (``run``, start and end on the thread that runs it), each wait
on the core's ``Work`` (``wait``), and each ``Tensor.backward`` (``backward``). Times are
``time.perf_counter()``, one clock for every process of the machine. ``summarize.py`` reads them.
A diagnostic for benchmarks only: nothing of slipstream's imports or uses it.
"""

import json
import os
import threading
import time

_DIR = os.environ.get("SS_TRACE_DIR")

if _DIR:
    _lock = threading.Lock()
    _files = {}

    def _record(**event):
        rank = os.environ.get("RANK")
        if rank is None:  # the launcher, or a rank before its environment is set
            return
        event["th"] = threading.current_thread().name
        with _lock:
            f = _files.get(os.getpid())
            if f is None:
                path = os.path.join(_DIR, f"rank{rank}-{os.getpid()}.jsonl")
                f = _files[os.getpid()] = open(path, "a", buffering=1)
            f.write(json.dumps(event) + "\n")

    import torch
    from slipstream.core_comm import communicator, work

    _resize, _resize_as = communicator.Communicator._resize, communicator.Communicator._resize_as
    _wait, _backward = work.Work.wait, torch.Tensor.backward

    def _timed_resize(self, kind, algo, output, input, *args, **kwargs):
        start = time.perf_counter()
        result = _resize(self, kind, algo, output, input, *args, **kwargs)
        _record(ev="run", kind=kind, n=input.numel() * input.element_size(), t0=start, t1=time.perf_counter())
        return result

    def _issued_resize(self, counted, kind, output, input, op, async_op, *args, **kwargs):
        _record(ev="issue", kind=kind, n=input.numel() * input.element_size(), t=time.perf_counter())
        return _resize_as(self, counted, kind, output, input, op, async_op, *args, **kwargs)

    def _timed_wait(self, *args, **kwargs):
        start = time.perf_counter()
        result = _wait(self, *args, **kwargs)
        _record(ev="wait", t0=start, t1=time.perf_counter())
        return result

    def _timed_backward(self, *args, **kwargs):
        start = time.perf_counter()
        result = _backward(self, *args, **kwargs)
        _record(ev="backward", t0=start, t1=time.perf_counter())
        return result

    communicator.Communicator._resize, communicator.Communicator._resize_as = _timed_resize, _issued_resize
    work.Work.wait, torch.Tensor.backward = _timed_wait, _timed_backward
