"""``slipstream.data.AsyncLoader``: batches prepared on a background thread, ahead of the step.

``AsyncLoader(loader, device)`` iterates ``loader`` (its collation, tokenisation, and an
optional ``transform`` such as the varlen packing) on a background thread, ``prefetch``
batches ahead of the training loop. For a CUDA device, tensors are pinned and copied with
``non_blocking=True`` on a side stream, and the loop's stream waits for that copy before the
batch is handed over; elsewhere batches stay where the loader put them and only the
preparation overlaps the step.

An exception raised while preparing a batch is raised in the training loop at that batch, with
the worker's traceback. Leaving the loop early (``break``, an exception in the step) stops the
thread: when the iterator is closed or collected, or at the end of a ``with`` block.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable, Iterator

import torch

__all__ = ["AsyncLoader"]

_END = object()
_POLL_S = 0.1  # how often a blocked side checks that the other is still there


class AsyncLoader:
    """Iterate ``loader`` on a background thread, ``prefetch`` batches ahead, each batch passed
    through ``transform`` (if given) and moved to ``device`` (if given)."""

    def __init__(self, loader: Iterable, device: torch.device | str | None = None, *, prefetch: int = 2,
                 transform: Callable[[Any], Any] | None = None) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, got {type(transform).__name__}")
        self.loader, self.prefetch, self.transform = loader, prefetch, transform
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
        cuda = self._device is not None and self._device.type == "cuda"
        stream = torch.cuda.Stream(self._device) if cuda else None
        # the thread holds no reference to this iterator, so a loop left early lets it be
        # collected, and its collection stops the thread
        self._thread = threading.Thread(target=_produce, name="slipstream-async-loader", daemon=True,
                                        args=(owner.loader, owner.transform, self._queue, self._stop,
                                              self._device, stream))
        self._done = False
        self._thread.start()

    # ------------------------------------------------------------------ the training loop

    def __next__(self):
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()
                    raise RuntimeError("slipstream AsyncLoader: the loader thread ended without a batch or an "
                                       "error") from None
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item  # its __traceback__ holds the loader thread's frames
        batch, moved = item
        if moved is None:
            return batch
        moved, event = moved
        if event is not None:  # the loop's stream waits for the copy; the copy's memory lives on it
            current = torch.cuda.current_stream(self._device)
            current.wait_event(event)
            _map(moved, lambda t: t.record_stream(current) or t)
        return moved

    def close(self, join_s: float = 30.0) -> None:
        """Stop the thread and drop prefetched batches; wait up to ``join_s`` for the thread to
        finish the batch it is preparing."""
        self._done = True
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
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
    try:
        for batch in loader:
            if stop.is_set():
                return
            if transform is not None:
                batch = transform(batch)
            if not _put(q, stop, (batch, _to_device(batch, device, stream))):
                return
        _put(q, stop, _END)
    except BaseException as e:  # noqa: BLE001 - raised in the training loop instead
        _put(q, stop, e)


def _put(q: queue.Queue, stop: threading.Event, item) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _to_device(batch, device, stream):
    """``(the batch on device, the CUDA event that says the copy is done)``, or None."""
    if device is None:
        return None
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
