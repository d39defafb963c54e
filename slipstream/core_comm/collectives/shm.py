"""CPU-Reduce: allreduce, reduce-scatter and allgather among the ranks of one node through
POSIX shared memory.

Layout of the one segment a group shares (created by group rank 0)::

    control: world x 64 bytes        per rank, one cache line: step, seq, kind, numel, dtype, op, pid,
                                     and the address of the buffer peers access in place (cma.py)
    inputs:  world x 2 x slot_bytes  per rank, two slots (double buffering)
    results: 2 x slot_bytes          the reduced chunk; rank r writes only its slice r

Each rank writes only its own control line, input slots and result slice; peers read them in
place. Progress is a per-rank step counter: a rank publishes ``step += 1`` after a phase and
waits until every rank's counter reaches it (ranks issue the same phases, so equal counters
mean equal progress). Slots alternate between chunks: a rank copies chunk k+1 into one while
slower peers still reduce chunk k from the other. Large messages take the bandwidth-optimal
path (each rank reduces its slice of a chunk, peers copy the reduced slices out), those up to
``small_bytes`` the latency-optimal one (one synchronisation, every rank reduces the whole
message). fp16/bf16 accumulate in fp32.

Memory ordering: data is written before the step that publishes it and read after the step
is seen; x86-64 keeps stores in order and loads in order (TSO), and the GIL hand-offs around
each torch op are locked instructions, which also order streaming stores. Other
architectures fall back to the stock collective (``is_supported_platform``).

Set-up (``segment.py``): the segment's name is unlinked once every rank has mapped it, so
nothing is left in /dev/shm even after a SIGKILL; the name of a creator that died in those
milliseconds is removed by the next set-up on the machine or ``slipstream env --clean``.
"""

from __future__ import annotations

import os
import platform
import time

import numpy as np
import torch
import torch.distributed as dist

from ..ops import DTYPES, OPS, cannot_reduce, code, reduce_rows
from ..scratch import Scratch
from .segment import (_ABORTED, _ADDR, _DTYPE, _KIND, _LINE, _LINE_WORDS, _NUMEL, _OP, _PID, _SEQ, _STEP,
                      KINDS_HERE, ShmError, _describe, _map_segment, _process_gone, futex_wait, futex_wake)

__all__ = ["ShmComm", "ShmError", "check_sizes", "is_supported_platform"]

ReduceOp = dist.ReduceOp
_SPINS = 64  # a waiting rank's yields before it sleeps until a peer's step wakes it
_CHECK_EVERY_S = 0.05  # how often a waiting rank looks for dead peers and its timeout


def is_supported_platform() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


class ShmComm:
    """Collectives among the ranks of ``group``, all on one node; construction is collective.
    Tensors: CPU, of a dtype in ``ops.REDUCIBLE_DTYPES``, with an op in ``ops.OPS`` (AVG for
    floating dtypes only); callers check ``supports`` and use the stock collective otherwise."""

    __slots__ = (
        # set-up
        "group", "rank", "world", "global_ranks", "slot_bytes", "small_bytes", "timeout", "segment_name",
        # the mapping and views into it
        "_mm", "_ctrl", "_steps", "_step_addrs", "_inputs", "_results", "_views",
        # progress
        "_step", "_seq", "_next_slot", "_slot_free_at", "_unchecked", "_broken",
        # fp32 rows for reducing fp16/bf16 (ops.reduce_rows), kept from call to call
        "_scratch",
    )

    def __init__(self, group: dist.ProcessGroup | None = None, *, slot_bytes: int = 1 << 20,
                 small_bytes: int = 64 << 10, timeout: float = 300.0) -> None:
        if slot_bytes % _LINE or slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be a positive multiple of {_LINE}, got {slot_bytes}")
        if not 0 <= small_bytes <= slot_bytes:
            raise ValueError(f"small_bytes must be in [0, slot_bytes], got {small_bytes}")
        if not is_supported_platform():
            raise ShmError(f"shared-memory collectives need x86-64 Linux, not {platform.machine()}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.global_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world))
        self.slot_bytes, self.small_bytes, self.timeout = slot_bytes, small_bytes, timeout
        w = self.world
        nbytes = w * _LINE + (w + 1) * 2 * slot_bytes
        self._mm, self.segment_name = _map_segment(group, self.rank, nbytes)
        self._ctrl = np.frombuffer(self._mm, dtype=np.int64, count=w * _LINE_WORDS).reshape(w, _LINE_WORDS)
        self._steps = self._ctrl[:, _STEP]
        self._step_addrs = [self._ctrl[r:].ctypes.data for r in range(w)]  # the futex words
        data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=w * _LINE, count=(w + 1) * 2 * slot_bytes)
        self._inputs = data[: w * 2 * slot_bytes].view(w, 2, slot_bytes)
        self._results = data[w * 2 * slot_bytes:].view(2, slot_bytes)
        self._views: dict = {}
        self._step = self._seq = self._next_slot = 0
        self._slot_free_at = [0, 0]
        self._unchecked = False
        self._broken: str | None = None
        self._scratch = Scratch(1)
        self._ctrl[self.rank, _PID] = os.getpid()
        try:
            dist.barrier(group=group)  # every pid is written before anyone waits on peers
        except RuntimeError as e:  # gloo's, which names no one
            raise RuntimeError(f"slipstream: the shared-memory set-up of global ranks "
                               f"{dist.get_process_group_ranks(group)} failed: one of them died or did not "
                               f"arrive ({e})") from e

    @staticmethod
    def supports(tensor: torch.Tensor, op=ReduceOp.SUM) -> str | None:
        """None if the tensor and op can take this path, else the reason they cannot."""
        if tensor.device.type != "cpu":
            return f"device {tensor.device} is not cpu"
        return cannot_reduce(tensor.dtype, op)

    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM) -> None:
        """In place: ``tensor`` (any shape, any strides) becomes the reduction over ranks."""
        self._check(tensor, op)
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = work.view(-1)
        self._begin("all_reduce", flat, op)
        if flat.numel():
            if flat.numel() * flat.element_size() <= self.small_bytes:
                self._all_reduce_small(flat, op)
            else:
                self._all_reduce_large(flat, op)
        if work is not tensor:
            tensor.copy_(work)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM) -> None:
        """``output: (n,)`` on rank r gets the reduction of ``input.view(world, n)[r]``."""
        self._check(input, op)
        self._check(output, op)
        check_sizes("reduce_scatter", output, input, self.world)
        n, w = output.numel(), self.world
        inp = input.reshape(w, n)
        out = output if output.is_contiguous() else torch.empty_like(output)
        flat_out = out.view(-1)
        self._begin("reduce_scatter", inp, op)
        cols = max(1, self._capacity(input.dtype) // w)
        for lo in range(0, n, cols):
            c = min(n, lo + cols) - lo
            ins, _ = self._acquire_slot(input.dtype)
            ins[self.rank, : w * c].view(w, c).copy_(inp[:, lo:lo + c])
            self._sync()
            reduce_rows(ins[:, self.rank * c:(self.rank + 1) * c], flat_out[lo:lo + c], op, w, self._rows())
            self._release_slot()
        if out is not output:
            output.copy_(out)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output: (world * n,)`` gets every rank's ``input: (n,)`` in rank order. ``input``
        may be a view into ``output`` (FSDP2 does this): its row is rewritten with the values
        it already holds."""
        self._check(input, ReduceOp.SUM)
        self._check(output, ReduceOp.SUM)
        check_sizes("all_gather", output, input, self.world)
        n = input.numel()
        out = output if output.is_contiguous() else torch.empty_like(output)
        rows = out.view(self.world, n)
        src = input.reshape(-1)
        self._begin("all_gather", src, ReduceOp.SUM)
        cap = self._capacity(input.dtype)
        for lo in range(0, n, cap):
            c = min(n, lo + cap) - lo
            ins, _ = self._acquire_slot(input.dtype)
            ins[self.rank, :c].copy_(src[lo:lo + c])
            self._sync()
            rows[:, lo:lo + c].copy_(ins[:, :c])
            self._release_slot()
        if out is not output:
            output.copy_(out)

    def start(self, kind: str, t: torch.Tensor, op, addr: int) -> np.ndarray:
        """Begin a call whose peers access this rank's buffer at ``addr`` in place (cma.py):
        publish it, synchronise, and return every rank's address, ``(world,) int64``."""
        self._check(t, op)
        self._begin(kind, t, op)
        self._ctrl[self.rank, _ADDR] = addr
        self._sync()
        return self._ctrl[:, _ADDR].copy()

    def finish(self, failed: bool = False) -> None:
        """End a call begun with ``start``: wait until every rank gets here, as peers may
        write into this rank's buffer until then. A rank whose part failed comes too, with
        ``failed``, and then every rank raises ``ShmError`` instead of returning."""
        if failed:
            self._ctrl[self.rank, _SEQ] = _ABORTED
        self._sync()
        aborted = np.flatnonzero(self._ctrl[:, _SEQ] == _ABORTED)
        if aborted.size:
            self.fail(f"{self.who(int(aborted[0]))} failed during collective #{self._seq}")

    def held_bytes(self) -> int:
        """What this rank holds: the node's segment (mapped whole by every rank) and its arena."""
        return (0 if self._mm.closed else len(self._mm)) + self._scratch.nbytes

    def close(self) -> None:
        self._broken = self._broken or "closed"
        # Drop every view so the mapping can close.
        self._inputs = self._results = self._ctrl = self._steps = None
        self._views.clear()
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the last reference

    # Each phase of a chunk is one torch op over a strided view of every rank's slot, so
    # Python overhead per chunk stays a few microseconds. 1 MiB slots: of 256 KiB, 1 MiB and
    # 4 MiB on 1 node x 4 ranks (2-core VM), 256 KiB lost to synchronisation (2.5x slower at
    # 64 MiB) and 1-4 MiB were within noise. Large messages are DRAM-bound: the input is read
    # and the output written once; everything in between stays in cache. Reducing the whole
    # chunk on every rank (one sync instead of two) measured slower, 87 vs 79 ms at 64 MiB.

    def _all_reduce_small(self, flat: torch.Tensor, op) -> None:
        n = flat.numel()
        ins, _ = self._acquire_slot(flat.dtype)
        ins[self.rank, :n].copy_(flat)
        self._sync()
        reduce_rows(ins[:, :n], flat, op, self.world, self._rows())
        self._release_slot()

    def _all_reduce_large(self, flat: torch.Tensor, op) -> None:
        cap = self._capacity(flat.dtype)
        align = max(1, _LINE // flat.element_size())
        for lo in range(0, flat.numel(), cap):
            m = min(flat.numel(), lo + cap) - lo
            bounds = _split(m, self.world, align)
            a, b = bounds[self.rank], bounds[self.rank + 1]
            ins, res = self._acquire_slot(flat.dtype)
            ins[self.rank, :m].copy_(flat[lo:lo + m])
            self._sync()
            if b > a:
                reduce_rows(ins[:, a:b], res[a:b], op, self.world, self._rows())
            self._sync()
            flat[lo:lo + m].copy_(res[:m])
            self._release_slot()

    def _rows(self):
        """Where ``reduce_rows`` takes its fp32 rows for one reduction."""
        self._scratch.begin(0)
        return self._scratch.taker(0)

    def _capacity(self, dtype: torch.dtype) -> int:
        return self.slot_bytes // dtype.itemsize

    def _acquire_slot(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait until every peer finished reading the next slot's last use; return typed
        views ``(inputs: (world, capacity), result: (capacity,))`` of it."""
        slot = self._next_slot
        self._wait_all(self._slot_free_at[slot])
        key = (slot, dtype)
        if key not in self._views:
            self._views[key] = (self._inputs[:, slot].view(dtype), self._results[slot].view(dtype))
        return self._views[key]

    def _release_slot(self) -> None:
        self._slot_free_at[self._next_slot] = self._publish()
        self._next_slot ^= 1

    def _sync(self) -> None:
        self._wait_all(self._publish())
        if self._unchecked:  # after the first sync of a call every peer has begun it
            self._unchecked = False
            self._check_peers_match()

    def _publish(self) -> int:
        self._step += 1
        self._ctrl[self.rank, _STEP] = self._step
        futex_wake(self._step_addrs[self.rank])  # peers asleep on this rank's step
        return self._step

    def _begin(self, kind: str, t: torch.Tensor, op) -> None:
        """Record this call so peers can check they are running the same one."""
        self._seq += 1
        line = self._ctrl[self.rank]
        line[_SEQ] = 0  # seqlock: invalid while the fields change
        line[_KIND] = code(KINDS_HERE, kind)
        line[_NUMEL] = t.numel()
        line[_DTYPE] = code(DTYPES, t.dtype)
        line[_OP] = code(OPS, op)
        line[_SEQ] = self._seq  # written last: peers compare fields only at an equal seq
        self._unchecked = True

    def _check(self, t: torch.Tensor, op) -> None:
        if self._broken:
            raise ShmError(f"shared-memory communicator is unusable: {self._broken}")
        reason = self.supports(t, op)
        if reason:
            raise ValueError(f"shared-memory collective: {reason}")

    def _wait_all(self, target: int) -> None:
        steps = self._steps
        if steps.min() >= target:
            return
        start = time.monotonic()
        spins = 0
        next_check = _CHECK_EVERY_S
        while steps.min() < target:
            spins += 1
            # 4 ranks on 2 cores is common here: give the core to a peer that has work, and
            # after a short spin sleep in the kernel until the late peer's step moves (the GIL
            # released): no wake-ups while a peer computes (a rank waiting seconds for a peer's
            # backward used to wake 1000-20000 times a second, taking the core from the ranks
            # still computing), and the kernel's network work (softirq) runs meanwhile.
            if spins < _SPINS:
                os.sched_yield()
                continue
            late = int(steps.argmin())
            step = int(steps[late])
            if step < target:  # else it moved meanwhile: look again
                futex_wait(self._step_addrs[late], step, max(1e-3, next_check - (time.monotonic() - start)))
            waited = time.monotonic() - start
            if waited >= next_check:  # a dead peer or the timeout is seen within 50 ms
                self._check_progress(target, waited)
                next_check = waited + _CHECK_EVERY_S

    def _check_progress(self, target: int, waited: float) -> None:
        late = [r for r in range(self.world) if self._steps[r] < target]
        for r in late:
            pid = int(self._ctrl[r, _PID])
            if _process_gone(pid):
                self.fail(f"{self.who(r, pid)} died during a collective")
        if waited > self.timeout:
            self.fail(f"timed out after {waited:.0f}s waiting for {', '.join(self.who(r) for r in late)}: are "
                      "all ranks calling the same collective with the same tensor size, dtype and device? "
                      "(SLIPSTREAM_DEBUG=1 checks this before every collective)")

    def _check_peers_match(self) -> None:
        # A peer that finished this call may already be rewriting its line for the next
        # one; a line counts only if its seq is ours both before and after reading it.
        mine = self._ctrl[self.rank].copy()
        before = self._ctrl[:, _SEQ].copy()
        fields = self._ctrl[:, _KIND:_OP + 1].copy()
        same_call = (before == self._seq) & (self._ctrl[:, _SEQ] == self._seq)
        bad = np.flatnonzero(same_call & (fields != mine[_KIND:_OP + 1]).any(axis=1))
        if bad.size:
            r = int(bad[0])
            self.fail(f"collective #{self._seq} differs between ranks: {self.who(self.rank)} runs "
                      f"{_describe(mine[_KIND:])}, {self.who(r)} runs {_describe(fields[r])}")

    def who(self, r: int, pid: int | None = None) -> str:
        """Local rank ``r`` as errors name it: ``local rank 1 (global rank 3, pid 4242)``."""
        return f"local rank {r} (global rank {self.global_ranks[r]}" + (f", pid {pid})" if pid else ")")

    def fail(self, why: str) -> None:
        """Mark the communicator unusable and raise ``ShmError(why)``."""
        self._broken = why
        raise ShmError(why)


def _split(n: int, parts: int, align: int) -> list[int]:
    """Boundaries of ``parts`` near-equal slices of ``n`` elements, interior ones aligned."""
    step = -(-n // parts)
    step = -(-step // align) * align
    return [min(n, i * step) for i in range(parts)] + [n]


def check_sizes(kind: str, output: torch.Tensor, input: torch.Tensor, world: int) -> None:
    """``output`` holds ``world`` blocks of ``input``'s size (allgather) or the reverse."""
    big, small = (output, input) if kind == "all_gather" else (input, output)
    if big.numel() != small.numel() * world or output.dtype != input.dtype:
        raise ValueError(f"{kind}: output {tuple(output.shape)} {output.dtype} and input {tuple(input.shape)} "
                         f"{input.dtype}: expected the {'output' if big is output else 'input'} to hold "
                         f"world_size ({world}) times the elements of the other, of the same dtype")
