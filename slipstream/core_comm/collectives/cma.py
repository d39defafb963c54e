"""Allreduce, reduce-scatter and allgather among the ranks of one node on the peers' tensors
in place, through cross-memory attach (``process_vm_readv(2)``, ``process_vm_writev(2)``).

Where ``shm.py`` copies every input into the shared segment and every result out, here each
rank publishes its tensor's address on its ``ShmComm`` control line and the kernel copies
between the peers' pages and ours, once. An allreduce of S bytes on n ranks, on rank r:

1. publish the address and synchronise (``ShmComm.start``, which checks the calls match);
2. for each ``chunk_bytes`` chunk of slice r: read the chunk of every peer into a scratch that
   stays in the L2 cache and combine it into this rank's own chunk, then write the result into
   the same chunk of every peer. Only rank r touches slice r of any tensor: no other sync;
3. synchronise (``ShmComm.finish``): no rank returns, and may change its tensor, while a peer
   still reads or writes it.

One rank computes each slice, so every rank ends with the same bits; each reads S and writes S
of its own memory, and the kernel moves 2(n-1)/n x S. A reduce-scatter is step 2 without the
writes; an allgather writes each input chunk into this rank's row of its output and from there
into the same row of every peer's. Writing the results rather than reading them after a second
barrier: a 64 MiB fp32 allreduce on 1 node x 4 ranks (2-core KVM Xeon, chrt -f 10) took 48-52
ms against 60-69 ms reading them, 86-94 ms for gloo (`slipstream bench comm`; in the history
of benchmarks/results/comm_*.md): the kernel copies pages at 4-6 GB/s when it reads them from
DRAM but at 11 GB/s when it writes from a source in cache.

Failures: a rank whose copy fails (ESRCH: the peer died) marks its call aborted and still waits
at step 3, as peers may be writing into its tensor; then every rank raises ``ShmError``. When
a rank dies, a survivor may return while another survivor, within its chunk, still writes into
its tensor. The kernel allows these calls only to a process that may ptrace the peer (same uid
and Yama's ptrace_scope, or CAP_SYS_PTRACE), and seccomp filters of container runtimes may
refuse them: ``CmaComm`` probes once at set-up, so that all ranks use it or none does.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets

import torch
import torch.distributed as dist

from ..ops import COMBINE, level_op, overlaps
from .shm import ShmComm, ShmError, _split, check_sizes

__all__ = ["CmaComm", "read_peer", "write_peer"]

ReduceOp = dist.ReduceOp


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _bind(name: str):
    fn = getattr(ctypes.CDLL(None, use_errno=True), name, None)
    if fn is not None:  # ctypes releases the GIL around the call
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                       ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_ssize_t
    return fn


_readv = _bind("process_vm_readv")
_writev = _bind("process_vm_writev")


def read_peer(pid: int, dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``src`` of process ``pid`` to ``dst`` of this process.
    Raises ``OSError`` (EPERM: not allowed; ESRCH: no such process; EFAULT: bad address)."""
    _transfer(_readv, "process_vm_readv", pid, dst, src, nbytes)


def write_peer(pid: int, dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``src`` of this process to address ``dst`` of process ``pid``."""
    _transfer(_writev, "process_vm_writev", pid, src, dst, nbytes)


def _transfer(fn, name: str, pid: int, local: int, remote: int, nbytes: int) -> None:
    if fn is None:
        raise OSError(errno.ENOSYS, f"libc has no {name}")
    done = 0
    while done < nbytes:  # the kernel may copy less than asked
        mine = _IoVec(local + done, nbytes - done)
        theirs = _IoVec(remote + done, nbytes - done)
        got = fn(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
        if got <= 0:
            code = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(code, f"{name}: {os.strerror(code)}")
        done += got


class CmaComm:
    """In-place collectives over the ranks of ``shm``'s group, for the CPU tensors, dtypes and
    ops of ``ShmComm`` (fp16/bf16 sums and products accumulate in fp32; AVG divides the sum).
    Construction is collective over ``shm.group`` and raises ``ShmError`` on every rank when
    any rank cannot read and write a peer. Calls are ordered with ``shm``'s own: both count
    steps on the same control lines.

    ``chunk_bytes`` per peer read: 256 KiB kernel reads ran at 6.3 GB/s, 128 KiB at 5.4 and
    64 KiB at 4.7 on the benchmark machine, and the chunk must stay in its 2 MiB L2.
    """

    __slots__ = ("shm", "chunk_bytes", "_pids", "_scratch", "_acc")

    def __init__(self, shm: ShmComm, *, chunk_bytes: int = 256 << 10) -> None:
        if chunk_bytes <= 0 or chunk_bytes % 64:
            raise ValueError(f"chunk_bytes must be a positive multiple of 64, got {chunk_bytes}")
        self.shm = shm
        self.chunk_bytes = chunk_bytes
        self._pids = _probe(shm.group, shm.rank)
        self._scratch = torch.empty(chunk_bytes, dtype=torch.uint8)  # one peer's chunk
        self._acc = torch.empty(2, chunk_bytes // 2, dtype=torch.float32)  # fp16/bf16: the sum, a peer's chunk

    def held_bytes(self) -> int:
        """Its chunk buffers' bytes."""
        return self._scratch.numel() + 4 * self._acc.numel()

    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM) -> None:
        """In place: ``tensor`` (any shape) becomes the reduction over ranks."""
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = work.view(-1)
        if flat.numel() == 0:
            return
        addrs = self.shm.start("cma_all_reduce", flat, op, flat.data_ptr())
        with self._call():
            bounds = _split(flat.numel(), self.shm.world, max(1, 4096 // flat.element_size()))
            a, b = bounds[self.shm.rank], bounds[self.shm.rank + 1]
            self._reduce(flat[a:b], flat[a:b], addrs, a * flat.element_size(), op, push=True)
        if work is not tensor:
            tensor.copy_(work)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM) -> None:
        """``output: (n,)`` on rank r gets the reduction of ``input.view(world, n)[r]``."""
        n, r = output.numel(), self.shm.rank
        check_sizes("reduce_scatter", output, input, self.shm.world)
        if n == 0:
            return
        src = input.reshape(-1) if input.is_contiguous() else input.contiguous().view(-1)
        out = output if output.is_contiguous() else torch.empty_like(output)
        if overlaps(out, src) and out.data_ptr() != src[r * n:].data_ptr():
            out = torch.empty_like(output)  # peers read every block of ``src`` but ours
        addrs = self.shm.start("cma_reduce_scatter", src, op, src.data_ptr())
        with self._call():
            self._reduce(out.view(-1), src[r * n:(r + 1) * n], addrs, r * n * src.element_size(), op)
        if out is not output:
            output.copy_(out)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output: (world * n,)`` gets every rank's ``input: (n,)`` in rank order;
        ``input`` may be this rank's row of ``output`` (FSDP2 does this)."""
        n, r = input.numel(), self.shm.rank
        check_sizes("all_gather", output, input, self.shm.world)
        if n == 0:
            return
        src = input.reshape(-1) if input.is_contiguous() else input.contiguous().view(-1)
        out = output if output.is_contiguous() else torch.empty_like(output)
        rows = out.view(self.shm.world, n)
        if overlaps(out, src) and rows[r].data_ptr() != src.data_ptr():
            src = src.clone()  # peers fill our other rows while we still read it
        addrs = self.shm.start("cma_all_gather", out, ReduceOp.SUM, out.data_ptr())
        with self._call():
            self._broadcast_row(rows[r], src, addrs)
        if out is not output:
            output.copy_(out)

    @contextlib.contextmanager
    def _call(self):
        """The part of a call between ``shm.start`` and ``shm.finish``. A rank that fails
        still waits for its peers (they may be writing into its tensor), then all raise."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(ShmError):
                self.shm.finish(failed=True)
            raise
        self.shm.finish()

    def _broadcast_row(self, row: torch.Tensor, src: torch.Tensor, addrs) -> None:
        """Copy ``src: (n,)`` into ``row``, this rank's row of its output, and into the same
        place of every peer's output, per chunk from a copy that is still in cache."""
        esz, cap = src.element_size(), self.chunk_bytes // src.element_size()
        offset = row.data_ptr() - int(addrs[self.shm.rank])
        for lo in range(0, src.numel(), cap):
            m = min(src.numel() - lo, cap)
            hot = row[lo:lo + m]
            if hot.data_ptr() == src[lo:].data_ptr():  # FSDP2: already in place, maybe cold
                hot = self._scratch.view(src.dtype)[:m]
            hot.copy_(src[lo:lo + m])
            for j in self._peers():
                self._io(write_peer, j, int(addrs[j]) + offset + lo * esz, hot.data_ptr(), m * esz)

    def _reduce(self, dst: torch.Tensor, own: torch.Tensor, addrs, offset: int, op,
                push: bool = False) -> None:
        """``dst: (m,)`` = op over ranks of the ``m`` elements at byte ``offset`` of every
        rank's buffer, this rank's being ``own: (m,)`` (``dst`` may be ``own``); with
        ``push``, also written to the same place in every peer's buffer. Peers are combined
        one at a time, in ``_peers`` order."""
        fn = COMBINE[level_op(op)]
        upcast = dst.dtype in (torch.float16, torch.bfloat16) and fn in (torch.add, torch.mul)
        row = self._scratch.view(dst.dtype)
        esz, cap = dst.element_size(), row.numel()
        for lo in range(0, dst.numel(), cap):
            m = min(dst.numel() - lo, cap)
            out = dst[lo:lo + m]
            acc = self._acc[0, :m].copy_(own[lo:lo + m]) if upcast else out
            first = acc if upcast else own[lo:lo + m]
            for k, j in enumerate(self._peers()):
                self._io(read_peer, j, row.data_ptr(), int(addrs[j]) + offset + lo * esz, m * esz)
                # Upcast into a kept row: torch's mixed add makes a new fp32 copy of each peer's chunk,
                # 512 KiB a time from glibc's heaps.
                peer = self._acc[1, :m].copy_(row[:m]) if upcast else row[:m]
                fn(first if k == 0 else acc, peer, out=acc)
            if op == ReduceOp.AVG:
                acc.div_(self.shm.world)
            if upcast:
                out.copy_(acc)
            for j in self._peers() if push else ():
                self._io(write_peer, j, int(addrs[j]) + offset + lo * esz, out.data_ptr(), m * esz)

    def _io(self, fn, peer: int, dst: int, src: int, nbytes: int) -> None:
        try:
            fn(self._pids[peer], dst, src, nbytes)
        except OSError as e:
            self.shm.fail(f"copying {nbytes} bytes with {self.shm.who(peer, self._pids[peer])} failed: {e}")

    def _peers(self) -> list[int]:
        """Every other rank, starting after this one, so that ranks spread their accesses."""
        r, w = self.shm.rank, self.shm.world
        return [(r + k) % w for k in range(1, w)]


def _probe(group, rank: int) -> list[int]:
    """Every rank reads a random token from every peer and writes it back; return the
    ranks' pids, or raise ``ShmError`` on every rank if any rank failed. Collective."""
    world = dist.get_world_size(group)
    token = secrets.token_bytes(16)
    buf = torch.frombuffer(bytearray(token), dtype=torch.uint8)
    peers: list = [None] * world
    dist.all_gather_object(peers, (os.getpid(), buf.data_ptr(), token), group=group)
    got = torch.zeros(16, dtype=torch.uint8)
    errors = []
    for j, (pid, addr, expected) in enumerate(peers):
        if j == rank:
            continue
        try:
            read_peer(pid, got.data_ptr(), addr, 16)
            if bytes(got.tolist()) != expected:
                errors.append(f"local rank {rank} read other bytes than local rank {j} (pid {pid}) holds")
            write_peer(pid, addr, got.data_ptr(), 16)  # the same bytes: harmless
        except OSError as e:
            errors.append(f"local rank {rank} cannot access local rank {j} (pid {pid}): {e}")
    every: list = [None] * world
    dist.all_gather_object(every, errors, group=group)  # also keeps ``buf`` alive until all are done
    failed = [e for errs in every for e in errs]
    if failed:
        raise ShmError(f"cross-memory attach is not usable: {failed[0]}")
    return [pid for pid, _, _ in peers]
