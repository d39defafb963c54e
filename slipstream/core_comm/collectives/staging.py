"""CUDA tensors through the CPU path: staged through pinned host memory, pipelined.

For chunk k the device-to-host copy runs on one stream while the CPU reduces chunk k-1 and a
second stream copies chunk k-2 back to the device, so the three overlap. Two pinned buffers
alternate; a buffer is refilled only after its host-to-device copy has finished.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["CudaStaging"]


class CudaStaging:
    """Pinned buffers and copy streams for one device, reused across calls."""

    __slots__ = ("device", "chunk_bytes", "_host", "_d2h", "_h2d", "_copied_back")

    def __init__(self, device: torch.device, chunk_bytes: int) -> None:
        if device.type != "cuda":
            raise ValueError(f"staging is for CUDA tensors, got device {device}")
        self.device = device
        self.chunk_bytes = chunk_bytes
        self._host = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._d2h = torch.cuda.Stream(device)
        self._h2d = torch.cuda.Stream(device)
        self._copied_back = [None, None]  # event per buffer: its last host-to-device copy done

    def all_reduce(self, tensor: torch.Tensor, reduce_on_host: Callable[[torch.Tensor], None]) -> None:
        """In place on a contiguous CUDA tensor; ``reduce_on_host(chunk)`` all-reduces one
        pinned host chunk in place (a collective: every rank calls it the same number of
        times). The copies follow the current stream's work and the current stream waits for
        them; the host waits for each chunk's copy in and, at the end, for the copies back, so
        that a caller told "done" from another thread (an async call's ``Work``) finds the
        result on the device whatever stream it reads it on."""
        flat = tensor.view(-1)
        step = self.chunk_bytes // flat.element_size()
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        chunks = [(lo, min(flat.numel(), lo + step)) for lo in range(0, flat.numel(), step)]
        ready: list = [None] * len(chunks)
        for k in range(len(chunks) + 1):
            if k < len(chunks):
                ready[k] = self._copy_in(flat, chunks[k], k % 2)
            if k >= 1:
                self._reduce_and_copy_back(flat, chunks[k - 1], (k - 1) % 2, ready[k - 1], reduce_on_host)
        torch.cuda.current_stream(self.device).wait_stream(self._h2d)
        flat.record_stream(self._d2h)
        flat.record_stream(self._h2d)
        self._h2d.synchronize()

    def _host_view(self, buf: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self._host[buf][: numel * dtype.itemsize].view(dtype)

    def _copy_in(self, flat, span, buf) -> torch.cuda.Event:
        lo, hi = span
        with torch.cuda.stream(self._d2h):
            if self._copied_back[buf] is not None:
                self._d2h.wait_event(self._copied_back[buf])
            self._host_view(buf, flat.dtype, hi - lo).copy_(flat[lo:hi], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._d2h)
        return event

    def _reduce_and_copy_back(self, flat, span, buf, ready, reduce_on_host) -> None:
        lo, hi = span
        ready.synchronize()
        host = self._host_view(buf, flat.dtype, hi - lo)
        reduce_on_host(host)
        with torch.cuda.stream(self._h2d):
            flat[lo:hi].copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._h2d)
        self._copied_back[buf] = event

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A pinned host copy of ``tensor`` (whole; for reduce-scatter and allgather)."""
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)
