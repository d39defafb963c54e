"""Multi-connection inter-node transport: every message split across K TCP connections.

Clouds cap a single TCP flow below the link rate, and one connection driven by one thread
rarely fills a fast link. ``MultiConnInter``, an ``InterTransport`` (``hierarchical.py``),
keeps K connections to each ring neighbour and cuts every block of a message into K pieces,
piece ``c`` travelling on connection ``c``. Algorithms among N peers (S bytes per rank):

    all_reduce, N = 2   one direct exchange: each sends its whole tensor and reduces what
                        arrives (S out of each node, the least possible, in one round trip)
    all_reduce, N > 2   ring reduce-scatter, then ring allgather (2(N-1)/N x S out of each node)
    reduce_scatter      ring, N-1 steps;  all_gather: ring, N-1 steps

Lane ``c`` (``_lanes.py``) is a thread that runs piece ``c`` of every call in call order, step
by step: send the header, post the receive, send the piece, wait for the receive, reduce (torch
ops and socket I/O release the GIL, so lanes and the caller run in parallel); a receiver thread
per lane reads its connection straight into the tensor (``recv_into``). Calls return a handle
at once; a call's pieces are queued on every lane under one lock, so calls keep their order.

Wire: before every piece (empty ones too) a 32-byte header names the call number, kind, dtype,
element count and piece size; the receiver checks them, so a mismatch between peers raises
instead of corrupting data. Any error (a dead peer, a timeout, a mismatch) breaks the
transport: every pending and later call raises that first error.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import weakref
from functools import partial
from typing import Mapping

import torch
import torch.distributed as dist

from ..ops import COMBINE, DTYPES, overlaps
from ..scratch import fresh
from ..work import Work
from ._lanes import TransportError, _connect, _Lanes, _Step
from ._lanes import _listen  # noqa: F401 - reached as transport._listen (tests)

__all__ = ["MultiConnInter", "TransportError", "endpoint_from_env"]

ReduceOp = dist.ReduceOp
_SIOCGIFADDR = 0x8915
# Lanes per step: at most one per 64 KiB. Handing a piece to a lane thread costs more than a
# small piece gains: splitting over all 4 lanes ran a 16 KiB allreduce at 0.38x the speed of
# K=1 and a 64 KiB one at 0.86x, a 256 KiB one at 3.2x (2 emulated nodes, 1gbit link,
# 250mbit per connection; benchmarks/results/transport_xeon-2core-kvm_2026-11-21.md).
_MIN_PIECE = 64 << 10


def endpoint_from_env(environ: Mapping[str, str] = os.environ) -> tuple[str, range | None]:
    """``(address, ports)`` to listen on: the IPv4 address of ``GLOO_SOCKET_IFNAME``'s (first)
    interface, else the host name's; ports from ``SLIPSTREAM_PORT_BASE`` up, else None
    (ports the kernel picks)."""
    ifname = environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname[:15].encode()))
            except OSError as e:
                raise TransportError(f"GLOO_SOCKET_IFNAME={ifname!r}: no IPv4 address ({e})") from None
        address = socket.inet_ntoa(raw[20:24])
    else:
        address = socket.gethostbyname(socket.gethostname())
    base = environ.get("SLIPSTREAM_PORT_BASE")
    if base is None:
        return address, None
    if not base.isdigit() or not 1 <= int(base) < 65536:
        raise ValueError(f"SLIPSTREAM_PORT_BASE={base!r}: expected a port number 1-65535")
    return address, range(int(base), 65536)


def _split(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``parts`` near-equal ranges (some empty when it is short)."""
    n = hi - lo
    return [(lo + n * p // parts, lo + n * (p + 1) // parts) for p in range(parts)]


def _finished(async_op: bool) -> Work | None:
    return Work.completed() if async_op else None


class MultiConnInter:
    """``InterTransport`` over ``connections`` TCP connections to each ring neighbour in
    ``group`` (this rank's peers on the other nodes, one per node). Construction is collective
    over ``group``, which carries the addresses; data never goes through it.
    ``address``/``ports``: where this rank listens (None: ``endpoint_from_env``'s). With
    ``ports``, each rank listens on K ports of its own (``_listen``), so that per-connection
    rate limits keyed on ports (the emulated cluster's) see one flow per port; without, the
    kernel picks them.
    ``timeout_s``: a peer that sends or takes nothing for this long raises ``TransportError``.
    Tensors: contiguous, CPU, of ``ops.DTYPES``; ops SUM, PRODUCT, MAX, MIN (AVG is the caller's).
    """

    __slots__ = ("group", "rank", "size", "connections", "timeout_s", "_lanes", "__weakref__")

    def __init__(self, group: dist.ProcessGroup, *, connections: int = 4, timeout_s: float = 300.0,
                 address: str | None = None, ports: range | None = None) -> None:
        if not 1 <= connections <= 16:
            raise ValueError(f"connections must be between 1 and 16, got {connections}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if address is None or ports is None:
            env_address, env_ports = endpoint_from_env()
            address, ports = address or env_address, ports if ports is not None else env_ports
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.connections, self.timeout_s = connections, timeout_s
        self._lanes: _Lanes | None = None
        if self.size > 1:
            self._lanes = _connect(group, self.rank, self.size, connections, timeout_s, address, ports)
            weakref.finalize(self, self._lanes.close)

    def close(self) -> None:
        """Close every connection; later calls raise. Idempotent."""
        if self._lanes is not None:
            self._lanes.close()

    def __enter__(self) -> "MultiConnInter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def all_reduce(self, shard: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False, scratch=None):
        """In place on ``shard`` (any shape, contiguous), like ``dist.all_reduce``."""
        reduce = self._check("all_reduce", op, shard)
        n, r, size = shard.numel(), self.rank, self.size
        if size == 1:
            return _finished(async_op)
        k = self._lanes_for(n * shard.element_size() // (1 if size == 2 else size))
        flat, tmp = shard.view(-1), (scratch or fresh)(n, shard.dtype)
        if size == 2:
            programs = [[(flat[a:b], tmp[a:b], partial(reduce, flat[a:b], tmp[a:b], out=flat[a:b]))]
                        for a, b in _split(0, n, k)]
            return self._submit("all_reduce", shard, programs, async_op)
        blocks = [flat[a:b] for a, b in _split(0, n, size)]
        tmps = [tmp[a:b] for a, b in _split(0, n, size)]
        programs = [self._ring_reduce(blocks, blocks, tmps, reduce, k, c)
                    + self._ring_gather(blocks, blocks[r], k, c) for c in range(k)]
        return self._submit("all_reduce", shard, programs, async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False,
                       lengths=None, scratch=None):
        """``out: (m,)`` gets block ``rank`` of the reduction of every peer's ``inp: (size*m,)``.
        ``lengths`` (the real part of each block) is not used: whole blocks cross the ring."""
        reduce = self._check("reduce_scatter", op, inp, out, inp.numel() == out.numel() * self.size)
        m = out.numel()
        if m and overlaps(out, inp):
            raise ValueError("reduce_scatter: out overlaps inp; pass a separate output tensor")
        if self.size == 1:
            out.copy_(inp.view_as(out))
            return _finished(async_op)
        blocks = [inp.view(-1)[b * m:(b + 1) * m] for b in range(self.size)]
        tmp = (scratch or fresh)(self.size * m, inp.dtype)
        tmps = [tmp[b * m:(b + 1) * m] for b in range(self.size)]
        tmps[self.rank] = out.view(-1)  # the last step reduces straight into ``out``
        k = self._lanes_for(m * out.element_size())
        programs = [self._ring_reduce(blocks, tmps, tmps, reduce, k, c) for c in range(k)]
        return self._submit("reduce_scatter", inp, programs, async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """``out: (size*m,)`` gets every peer's ``inp: (m,)`` in group-rank order."""
        self._check("all_gather", ReduceOp.SUM, inp, out, out.numel() == inp.numel() * self.size)
        m = inp.numel()
        if self.size == 1:
            out.copy_(inp.view_as(out))
            return _finished(async_op)
        blocks = [out.view(-1)[b * m:(b + 1) * m] for b in range(self.size)]
        k = self._lanes_for(m * inp.element_size())
        programs = [self._ring_gather(blocks, inp.view(-1), k, c) for c in range(k)]
        return self._submit("all_gather", inp, programs, async_op)

    def _ring_reduce(self, inp, acc, tmp, reduce, k: int, c: int) -> list[_Step]:
        """Ring reduce-scatter of piece ``c`` of each block: at step s, send block r-s-1 (the
        input at s = 0, else what step s-1 reduced into ``acc``), receive block r-s-2 into
        ``tmp`` and reduce ``acc = inp op tmp``; block r is complete after size-1 steps."""
        r, size, steps = self.rank, self.size, []
        for s in range(size - 1):
            sb, rb = (r - s - 1) % size, (r - s - 2) % size
            send = (inp if s == 0 else acc)[sb]
            send = send[slice(*_split(0, send.numel(), k)[c])]
            a, b = _split(0, tmp[rb].numel(), k)[c]
            steps.append((send, tmp[rb][a:b], partial(reduce, inp[rb][a:b], tmp[rb][a:b], out=acc[rb][a:b])))
        return steps

    def _ring_gather(self, blocks, mine: torch.Tensor, k: int, c: int) -> list[_Step]:
        """Ring allgather of piece ``c``: step s sends block r-s (``mine`` at s = 0, copied into
        place after it is sent) and receives block r-s-1 into place."""
        r, size, steps = self.rank, self.size, []
        a, b = _split(0, mine.numel(), k)[c]
        for s in range(size - 1):
            sb, rb = (r - s) % size, (r - s - 1) % size
            ra, rb_ = _split(0, blocks[rb].numel(), k)[c]
            if s == 0:
                own = blocks[r][a:b]
                post = None if own.data_ptr() == mine[a:b].data_ptr() else partial(own.copy_, mine[a:b])
                steps.append((mine[a:b], blocks[rb][ra:rb_], post))
            else:
                sa, sb_ = _split(0, blocks[sb].numel(), k)[c]
                steps.append((blocks[sb][sa:sb_], blocks[rb][ra:rb_], None))
        return steps

    def _check(self, kind: str, op, t: torch.Tensor, other: torch.Tensor | None = None, sizes_ok=True):
        for x in (t,) if other is None else (t, other):
            if x.device.type != "cpu" or not x.is_contiguous():
                raise ValueError(f"{kind}: needs contiguous CPU tensors, got {x.device} "
                                 f"{'contiguous' if x.is_contiguous() else 'non-contiguous'}")
        if t.dtype not in DTYPES or (other is not None and other.dtype != t.dtype):
            raise ValueError(f"{kind}: dtype {t.dtype} (and output {other.dtype if other is not None else '-'}) "
                             f"not supported: one of {', '.join(map(str, DTYPES))} for both")
        if not sizes_ok:
            raise ValueError(f"{kind}: output of {other.numel()} and input of {t.numel()} elements: one "
                             f"must hold {self.size} (peers) times the other")
        if op not in COMBINE:
            raise ValueError(f"{kind}: op {op} not supported (SUM, PRODUCT, MAX, MIN; AVG is a SUM "
                             "and a division by the caller)")
        return COMBINE[op]

    def _lanes_for(self, step_bytes: int) -> int:
        """Lanes for a step of ``step_bytes`` (the same on every peer whose call matches; lane 0
        always runs, so its header check catches a call that does not)."""
        return max(1, min(self.connections, step_bytes // _MIN_PIECE))

    def _submit(self, kind: str, t: torch.Tensor, programs, async_op: bool):
        work = self._lanes.submit(kind, t, programs)
        if async_op:
            return work
        work.wait()
        return None
