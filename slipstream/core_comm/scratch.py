"""The hierarchical collectives' temporaries (a chunk's shard, a peer's received block, an
fp32 accumulator), kept from call to call.

glibc's mmap threshold rises to the size of each mapped block freed (up to 32 MiB), so later
blocks up to that size come from its heaps, and freed ones stay there for reuse. Temporaries
of every size (a chunk is a share of each message) left those heaps fragmented: in a soak of
4,000 random calls on 2 emulated nodes, the ranks' resident memory grew 15-29% from the
1,000th call to the last, where what they held once glibc returned its free memory grew
under 5%, and with glibc's threshold fixed at 1 MiB 1-2% (``benchmarks/results/faults_*.md``).
Rounding each temporary up to a power of two did not help (12-40%); mapping each afresh from
the system cost 3-4.5 ms of page faults per 8 MiB here, against 0.4 ms from the heap.

So each chunk in flight has an arena of its own, ``slots`` of them in a ring: a chunk's
temporaries are carved from its slot's arena, which is reused by the chunk ``slots`` later,
once that one is finished. The arenas are mapped from the system, outside glibc's heaps, so
one outgrown is returned whole. A temporary over ``KEPT`` bytes is made and freed as before,
so that one huge call does not leave its chunks held.

The arenas all have the size of the most one chunk has taken: a slot outgrown by its chunk
sets the size, and every other slot takes it when its next chunk begins, its pages written
then. Which slot a call's largest chunk falls on depends on how many chunks the call has; with
one size for all, the memory held reaches its most at the first such chunk, not at the first
on each slot, and stays there (a rank's memory is flat from then on).
"""

from __future__ import annotations

import mmap

import torch

__all__ = ["KEPT", "Scratch", "fresh"]

KEPT = 32 << 20
"""Temporaries larger than this are not taken from an arena (glibc maps them itself)."""
_ALIGN = 64
_GRAIN = 1 << 20


def _mapped(nbytes: int) -> torch.Tensor:
    """``nbytes`` (rounded up to ``_GRAIN``) mapped from the system, not from glibc's heaps:
    unmapped once the last view of it is gone, and freeing it leaves glibc's threshold as it was."""
    return torch.frombuffer(mmap.mmap(-1, -(-nbytes // _GRAIN) * _GRAIN), dtype=torch.uint8)


def fresh(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A new uninitialised ``(numel,)`` tensor: the temporaries of a call given no arena."""
    return torch.empty(numel, dtype=dtype)


class Scratch:
    """The arenas of one communicator's chunks in flight (its calls run one at a time).
    ``slots``: at least the chunks in flight at once plus one. Memory held: ``slots`` times the
    most one chunk has taken (of ``KEPT``-sized pieces at most), once each slot has begun again."""

    __slots__ = ("_arenas", "_used")

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self._arenas = [torch.empty(0, dtype=torch.uint8) for _ in range(slots)]
        self._used = [0] * slots

    @property
    def nbytes(self) -> int:
        """The bytes its arenas hold (the temporaries over ``KEPT`` are not kept)."""
        return sum(a.numel() for a in self._arenas)

    def begin(self, slot: int) -> None:
        """Chunk ``slot`` (modulo the ring) starts: every piece its slot gave before is free.
        A slot smaller than another grows to its size here, its pages written."""
        i = slot % len(self._arenas)
        self._used[i] = 0
        size = max(a.numel() for a in self._arenas)
        if self._arenas[i].numel() < size:
            self._arenas[i] = _mapped(size).fill_(0)

    def take(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous ``(numel,)`` tensor of ``dtype`` from ``slot``'s arena,
        valid until that slot begins again."""
        nbytes = numel * dtype.itemsize
        if nbytes > KEPT:
            return torch.empty(numel, dtype=dtype)
        i = slot % len(self._arenas)
        lo = self._used[i]
        arena = self._arenas[i]
        if lo + nbytes > arena.numel():  # grows; pieces given before keep the old arena alive
            arena = self._arenas[i] = _mapped(max(lo + nbytes, arena.numel() * 5 // 4))
        self._used[i] = lo + -(-nbytes // _ALIGN) * _ALIGN
        return arena[lo:lo + nbytes].view(dtype)

    def taker(self, slot: int):
        """``take`` for ``slot``, as a function of ``(numel, dtype)`` (what a transport is given)."""
        return lambda numel, dtype: self.take(slot, numel, dtype)

    def held(self) -> int:
        """Bytes the arenas hold."""
        return sum(a.numel() for a in self._arenas)
