"""``slipstream.data.AsyncLoader``: batches prepared on a background thread, ahead of the step.

A thread overlaps the step only with collation that releases the interpreter lock (tensor
work, tokenizers written in Rust); ``process=True`` collates in a forked child instead, whose
batches come back through shared memory. The child is a copy of the process at the first
``next``: what the loader changes while iterating (a sampler's position) changes in the child
only. Leaving the loop early stops the thread and the child: when the iterator is closed or
collected, or at the end of a ``with`` block.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import threading
import traceback
from typing import Any, Callable, Iterable, Iterator

import torch

__all__ = ["AsyncLoader"]

_END = object()
_POLL_S = 0.1  # how often a blocked side checks that the other is still there


class AsyncLoader:
    """Iterate ``loader`` on a background thread (``process=True``: in a forked child process),
    ``prefetch`` batches ahead, each batch passed through ``transform`` (if given) and moved to
    ``device`` (if given: for CUDA, pinned and copied ``non_blocking`` on a side stream, and the
    loop's stream waits for the copy). An error preparing a batch is raised in the loop at that
    batch, with the worker's traceback (a child's, as the exception's cause)."""

    def __init__(self, loader: Iterable, device: torch.device | str | None = None, *, prefetch: int = 2,
                 transform: Callable[[Any], Any] | None = None, process: bool = False) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, got {type(transform).__name__}")
        if process and "fork" not in torch.multiprocessing.get_all_start_methods():
            raise ValueError("AsyncLoader(process=True) needs the fork start method (Linux); use a thread "
                             "(process=False) or a DataLoader with workers")
        self.loader, self.prefetch, self.transform, self.process = loader, prefetch, transform, process
        self.device = torch.device(device) if device is not None else None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> "_Prefetcher":
        return _Prefetcher(self)


class _Prefetcher(Iterator):
    def __init__(self, owner: AsyncLoader) -> None:
        self._device = owner.device
        self._queue: queue.Queue = queue.Queue(maxsize=owner.prefetch)
        self._stop = threading.Event()
        stream = torch.cuda.Stream(self._device) if self._device is not None and self._device.type == "cuda" else None
        # the thread holds no reference to this iterator, so a loop left early lets it be
        # collected, and its collection stops the thread
        source, transform = owner.loader, owner.transform
        if owner.process:  # the child collates and transforms; the thread receives and moves
            source, transform = _forked(owner.loader, owner.transform, owner.prefetch), None
        self._thread = threading.Thread(target=_produce, name="slipstream-async-loader", daemon=True,
                                        args=(source, transform, self._queue, self._stop, self._device, stream))
        self._done = False
        self._thread.start()

    def __next__(self):
        if self._done:
            raise StopIteration
        try:
            item = _get(self._queue, self._thread.is_alive)
        except queue.Empty:
            self.close()
            raise RuntimeError("slipstream AsyncLoader: the loader thread ended without a batch or an error") from None
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item  # its __traceback__ holds the loader thread's frames
        batch, event = item
        if event is not None:  # the loop's stream waits for the copy; the copy's memory lives on it
            current = torch.cuda.current_stream(self._device)
            current.wait_event(event)
            _map(batch, lambda t: t.record_stream(current) or t)
        return batch

    def close(self, join_s: float = 30.0) -> None:
        """Stop the thread and drop prefetched batches; wait up to ``join_s`` for the thread to
        finish the batch it is preparing."""
        self._done = True
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        if join_s > 0 and self._thread is not threading.current_thread():
            self._thread.join(timeout=join_s)

    def __enter__(self) -> "_Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # a loop left early: the thread stops after its current batch
        if not self._done:
            self.close(join_s=0)


def _produce(loader, transform, q: queue.Queue, stop: threading.Event, device, stream) -> None:
    """The background thread: each batch (transformed, moved) into ``q``, then the end mark or
    the exception that stopped it; gives up as soon as ``stop`` is set."""
    batches = None
    try:
        batches = iter(loader)
        for batch in batches:
            if stop.is_set():
                return
            if transform is not None:
                batch = transform(batch)
            if not _put(q, stop.is_set, _to_device(batch, device, stream)):
                return
        _put(q, stop.is_set, _END)
    except BaseException as e:  # noqa: BLE001 - raised in the training loop instead
        _put(q, stop.is_set, e)
    finally:
        close = getattr(batches, "close", None)  # a generator's (a child process's) clean-up runs now
        if close is not None:
            close()


def _get(q, alive: Callable[[], bool]):
    """The next item of ``q``, waiting while ``alive()``; once the producer is gone, what it
    put just before going, else ``queue.Empty``."""
    while True:
        try:
            return q.get(timeout=_POLL_S)
        except queue.Empty:
            if not alive():
                return q.get(timeout=_POLL_S)


def _put(q, stopped: Callable[[], bool], item) -> bool:
    """Put ``item`` into ``q`` unless ``stopped()`` first; whether it was put."""
    while not stopped():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _to_device(batch, device, stream):
    """``(the batch on device, the CUDA event that says the copy is done, or None)``."""
    if device is None:
        return batch, None
    if stream is None:
        return _map(batch, lambda t: t.to(device)), None
    with torch.cuda.stream(stream):
        moved = _map(batch, lambda t: t.pin_memory().to(device, non_blocking=True) if t.device.type == "cpu"
                     else t.to(device, non_blocking=True))
        event = torch.cuda.Event()
        event.record(stream)
    return moved, event


def _map(batch, fn):
    """``fn`` on every tensor of a batch (tensors, dicts, lists, tuples, nested), the rest kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return type(batch)((k, _map(v, fn)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(_map(v, fn) for v in batch)
    if isinstance(batch, tuple):  # a namedtuple
        return type(batch)(*(_map(v, fn) for v in batch))
    return batch


class _RemoteTraceback(Exception):
    """The cause of an exception raised in the child: its traceback, as text."""


def _forked(loader, transform, prefetch: int):
    """Forks (at the first ``next``) a child that iterates ``loader`` (and ``transform``) and
    sends each batch back through a ``torch.multiprocessing`` queue; closing stops the child."""
    ctx = torch.multiprocessing.get_context("fork")
    q, done = ctx.Queue(maxsize=prefetch), ctx.Event()
    child = ctx.Process(target=_child, args=(loader, transform, q, done, os.getpid()),
                        name="slipstream-async-loader", daemon=True)
    child.start()
    try:
        while True:
            try:
                kind, payload = _get(q, child.is_alive)
            except queue.Empty:
                raise RuntimeError(f"slipstream AsyncLoader: its process exited (code {child.exitcode}) "
                                   "without a batch or an error") from None
            if kind == "end":
                return
            if kind == "error":
                error, text = payload
                raise error from _RemoteTraceback(f"in the AsyncLoader's process:\n{text}")
            yield payload
    finally:
        done.set()
        child.join(timeout=_POLL_S * 10)
        for end in (child.terminate, child.kill):  # still collating, or blocked on a full queue
            if child.is_alive():
                end()
                child.join(timeout=5)
        q.cancel_join_thread()
        q.close()


def _child(loader, transform, q, done, parent: int) -> None:
    """The child process: each batch into ``q``, then ``("end", None)`` or the error; stays
    until ``done`` (it serves the shared memory of the batches it sent) or the parent is gone."""
    torch.set_num_threads(1)  # one core's worth of collation; the step keeps the rest
    stopped = lambda: done.is_set() or os.getppid() != parent  # noqa: E731 - or the parent died
    try:
        for batch in loader:
            if transform is not None:
                batch = transform(batch)
            if not _put(q, stopped, ("batch", batch)):
                return
        _put(q, stopped, ("end", None))
    except BaseException as e:  # noqa: BLE001 - raised in the training loop instead
        text = traceback.format_exc()
        try:
            pickle.dumps(e)
        except Exception:  # noqa: BLE001 - an exception that cannot cross: its text does
            e = RuntimeError(f"{type(e).__name__}: {e}")
        _put(q, stopped, ("error", (e, text)))
    while not done.wait(_POLL_S * 10) and not stopped():
        pass

