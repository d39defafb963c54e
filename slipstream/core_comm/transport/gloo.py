"""The inter-node exchange through the stock backend (gloo) of a group of a rank's peers on
the other nodes: direct sends and receives, each peer getting exactly its part."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..ops import COMBINE, reduce_rows
from ..scratch import fresh
from ..work import Work

__all__ = ["GlooInter"]


class GlooInter:
    __slots__ = ("group", "rank", "size", "peers")

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.peers = [dist.get_global_rank(group, q) for q in range(self.size) if q != self.rank]
        """The global ranks this rank exchanges with, on the other nodes."""

    def all_reduce(self, shard, op, async_op=False, scratch=None):
        combine = COMBINE.get(op)
        if self.size != 2 or combine is None:
            return dist.all_reduce(shard, op=op, group=self.group, async_op=async_op)
        # Two peers swap their shards whole and combine them, in group-rank order on both so
        # that both hold the same bits: the same bytes on the link as gloo's ring (the shard
        # once each way) in one round instead of two. 16 MiB allreduce on 2x2 emulated nodes
        # at 1gbit (chrt -f 10, alternated runs): 153 ms against 161-168 with gloo's.
        received = (scratch or fresh)(shard.numel(), shard.dtype).view_as(shard)
        works = self.exchange([shard] * 2, [received] * 2)
        first, second = (shard, received) if self.rank == 0 else (received, shard)
        return _finish(works, lambda: combine(first, second, out=shard), async_op, self.peers)

    def reduce_scatter(self, out, inp, op, async_op=False, lengths=None, scratch=None):
        """``out: (m,)`` gets block ``rank`` of the reduction of every peer's ``inp: (size*m,)``.
        The reduction runs in ``wait()``, on the caller's thread. ``lengths[q]``: only the
        first so many elements of block q are sent (the rest is zero padding, left out of the
        sums; ``out`` beyond ``lengths[rank]`` is zero)."""
        # gloo's reduce-scatter moves as many bytes as an allreduce (measured on the emulated
        # link: 67 MiB out of a node for a 64 MiB reduce-scatter); a direct exchange sends
        # each peer exactly the block it owns, (N-1)/N of the input, the least possible.
        blocks = inp.view(self.size, out.numel())
        received = (scratch or fresh)(self.size * out.numel(), inp.dtype).view(self.size, out.numel())
        received[self.rank].copy_(blocks[self.rank])
        if lengths is None:
            works = self.exchange(blocks, received)
        else:
            mine = lengths[self.rank]
            received[:, mine:] = 0
            works = self.exchange([b[:n] for b, n in zip(blocks, lengths)], [row[:mine] for row in received])
        return _finish(works, lambda: reduce_rows(received, out, op, self.size, scratch), async_op, self.peers)

    def all_gather(self, out, inp, async_op=False):
        """``out: (size*m,)`` gets every peer's ``inp: (m,)`` in group-rank order."""
        # A direct exchange, like reduce_scatter: gloo's allgather moves the same bytes but
        # took 75-109 ms (median 88) for 4 MiB a rank where this takes 71-85 (median 73), and
        # 320-456 ms (374) vs 285-300 (294) for 16 MiB (2x2 emulated nodes, 1gbit, chrt -f 10).
        rows = out.view(self.size, inp.numel())
        rows[self.rank].copy_(inp)
        works = self.exchange([inp] * self.size, rows)
        return _finish(works, None, async_op, self.peers)

    def exchange(self, sends, recvs) -> list:
        """Send ``sends[q]`` to and receive ``recvs[q]`` from every peer q but this rank (any
        dtype, empty ones skipped); the handles of the sends and receives.

        Receives are posted before sends, each on its own: with ``batch_isend_irecv`` the
        reduce-scatter of 4 MiB a rank took 75-143 ms (median 83), with this 75-81 (78), and
        307-578 ms (364) vs 308-330 (322) for 16 MiB, against 70 and 281 ms of TCP goodput
        (2x2 emulated nodes, 1gbit, chrt -f 10). Calls between the same peers match in the
        order they are made (gloo queues sends and receives per peer and tag)."""
        peers = [(q, dist.get_global_rank(self.group, q)) for q in range(self.size) if q != self.rank]
        works = [dist.irecv(recvs[q], g, group=self.group) for q, g in peers if recvs[q].numel()]
        return works + [dist.isend(sends[q], g, group=self.group) for q, g in peers if sends[q].numel()]


def _finish(works: list, then: Callable[[], object] | None, async_op: bool, peers: list[int]) -> Work | None:
    """The exchange's handle: its ``wait()`` waits for every send and receive, then runs
    ``then`` (the reduction) once, on the waiting thread; without ``async_op``, now. gloo's
    error (a timeout, a lost connection) comes out naming the ``peers`` (global ranks)."""
    def finish() -> None:
        try:
            for work in works:
                work.wait()
        except RuntimeError as e:
            raise RuntimeError(f"exchange with global rank(s) {', '.join(map(str, peers))} on the other node(s) "
                               f"failed: {e} (the peer has died, hangs, is cut off: the link to it is down, or "
                               "has not called the same collective)") from e
        if then is not None:
            then()

    if async_op:
        return Work(finish=finish)
    finish()
    return None
