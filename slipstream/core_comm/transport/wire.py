"""The cross-node exchange in a lossy wire format (``CommConfig.wire``): an ``InterTransport``
that encodes what it sends (``codec``) and exchanges the payloads through the group's gloo.

    all_reduce      every peer's payload to every peer (an all-gather of payloads), each
                    decoded and summed in peer order: every peer holds the same bits
    reduce_scatter  each peer gets only its own block's payloads (direct sends); the block's
                    own part is summed at full precision
    all_gather      every peer's payload to every peer; every row, this rank's own too, is
                    the decoded payload, so all ranks hold the same values

Gradients (the reductions) go through ``ErrorFeedback``: what rounding took is sent the next
time the same call is made. All-gathered values (parameters) do not: each all-gather rounds
the sender's full-precision values afresh. Only SUM reaches here (AVG is a SUM, then the
caller's division); the routing rule decides which calls (``routing.wire_format``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..work import Work
from .codec import CODECS, ErrorFeedback
from .gloo import GlooInter

__all__ = ["WireInter"]

ReduceOp = dist.ReduceOp


class WireInter:
    """``InterTransport`` over ``gloo`` (the peers' group) in the wire format ``wire``
    (``codec.CODECS``). Tensors: contiguous CPU, of the codec's dtypes."""

    __slots__ = ("gloo", "codec", "feedback")

    def __init__(self, gloo: GlooInter, wire: str, feedback: ErrorFeedback | None = None) -> None:
        if wire not in CODECS:
            raise ValueError(f"wire must be one of {', '.join(CODECS)} (or 'full'), got {wire!r}")
        self.gloo = gloo
        self.codec = CODECS[wire]
        self.feedback = feedback if feedback is not None else ErrorFeedback()

    def held_bytes(self) -> int:
        """The error feedback's residuals, kept from step to step."""
        return self.feedback.resident_bytes()

    def payload_bytes(self, n: int) -> int:
        """Bytes on the link for ``n`` elements."""
        return self.codec.payload_bytes(n)

    def all_reduce(self, shard: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False, scratch=None):
        """``scratch`` is not used: the codec makes the encoded copies and the sums per call."""
        _sum_only("all_reduce", op)
        n, size = shard.numel(), self.gloo.size
        payload = self.feedback.encode(self.codec, ("all_reduce",), shard.view(-1))
        rows = torch.empty((size, payload.numel()), dtype=torch.uint8)
        work = self.gloo.all_gather(rows.view(-1), payload, async_op=True)

        def reduce() -> None:
            total = self.codec.decode(rows[0], n)
            for row in rows[1:]:
                total.add_(self.codec.decode(row, n))
            shard.view(-1).copy_(total)

        return _finish([work], reduce, async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False,
                       lengths: list[int] | None = None, scratch=None):
        """``out: (m,)`` gets block ``rank`` of the sum of every peer's ``inp: (size*m,)``;
        ``lengths[q]``: the real part of block q (the rest is zero, not sent). ``scratch``:
        not used, as for ``all_reduce``."""
        _sum_only("reduce_scatter", op)
        m, size, me = out.numel(), self.gloo.size, self.gloo.rank
        blocks = inp.view(size, m)
        lengths = [m] * size if lengths is None else lengths
        sends = [torch.empty(0, dtype=torch.uint8) if q == me else
                 self.feedback.encode(self.codec, ("reduce_scatter", q), blocks[q][:lengths[q]])
                 for q in range(size)]
        mine = lengths[me]
        recvs = [torch.empty(0 if q == me else self.codec.payload_bytes(mine), dtype=torch.uint8)
                 for q in range(size)]
        works = self.gloo.exchange(sends, recvs)

        def reduce() -> None:
            total = torch.zeros(m, dtype=torch.float32)
            for q in range(size):
                if q == me:
                    total.add_(blocks[me])
                else:
                    total[:mine].add_(self.codec.decode(recvs[q], mine))
            out.copy_(total)

        return _finish(works, reduce, async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """``out: (size*m,)`` gets every peer's ``inp: (m,)``, decoded, in group-rank order."""
        m, size = inp.numel(), self.gloo.size
        payload = self.codec.encode(inp.reshape(-1))
        rows = torch.empty((size, payload.numel()), dtype=torch.uint8)
        work = self.gloo.all_gather(rows.view(-1), payload, async_op=True)

        def place() -> None:
            for q, row in enumerate(out.view(size, m)):
                row.copy_(self.codec.decode(rows[q], m))

        return _finish([work], place, async_op)


def _sum_only(kind: str, op) -> None:
    if op != ReduceOp.SUM:
        raise ValueError(f"{kind}: a lossy wire format reduces with SUM only, got {op}")


def _finish(works: list, then: Callable[[], None], async_op: bool) -> Work | None:
    """A handle whose ``wait()`` waits for ``works`` and then runs ``then`` (the decoding), once,
    on the waiting thread; without ``async_op``, both now."""
    def finish() -> None:
        for work in works:
            work.wait()
        then()

    if async_op:
        return Work(finish=finish)
    finish()
    return None
