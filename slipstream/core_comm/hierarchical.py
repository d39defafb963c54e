"""Hierarchical collectives: inside the node through shared memory, across nodes through
the stock backend, each local rank with its peers (the ranks of the same local index on the
other nodes), all local ranks in parallel.

allreduce      = intra reduce-scatter -> inter allreduce of the shard -> intra allgather,
                 pipelined by chunk: the inter-node exchange of chunk k (gloo's worker thread)
                 overlaps the intra-node work of chunk k+1 (this thread).
reduce-scatter = intra reduce-scatter (blocks regrouped by local index) -> inter reduce-scatter
allgather      = inter allgather -> intra allgather (then blocks put back in group order)

Every node sends its data across its link once per other node's share, the least possible:
for 2 nodes, an allreduce of S bytes sends S bytes out of each node, where a flat ring over
all ranks sends 2(W-1)/W * S across the link that its ring crosses.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from .shm import ShmComm, reduce_rows
from .topology import Topology

__all__ = ["Hierarchical", "InterTransport", "GlooInter"]

ReduceOp = dist.ReduceOp
# AVG is a SUM at both levels and one division at the end; the rest keep their op.
_LEVEL_OP = {ReduceOp.AVG: ReduceOp.SUM}


class InterTransport(Protocol):
    """How a rank exchanges with its peers on the other nodes (one per node, in node order
    given by ``Hierarchical``'s inter positions). ``GlooInter`` is the default; a
    multi-connection TCP transport implements the same three calls. With ``async_op`` each
    returns a handle whose ``wait()`` completes the call (the data is in place after it)."""

    def all_reduce(self, shard: torch.Tensor, op, async_op: bool = False): ...
    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op, async_op: bool = False): ...
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False): ...


class GlooInter:
    """The inter-node exchange through the stock backend of a process group."""

    __slots__ = ("group", "rank", "size")

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def all_reduce(self, shard, op, async_op=False):
        return dist.all_reduce(shard, op=op, group=self.group, async_op=async_op)

    def reduce_scatter(self, out, inp, op, async_op=False):
        """``out: (m,)`` gets block ``rank`` of the reduction of every peer's ``inp: (size*m,)``.
        The reduction runs in ``wait()``, on the caller's thread."""
        # gloo's reduce-scatter moves as many bytes as an allreduce (measured on the emulated
        # link: 67 MiB out of a node for a 64 MiB reduce-scatter); a direct exchange sends
        # each peer exactly the block it owns, (N-1)/N of the input, the least possible.
        blocks = inp.view(self.size, out.numel())
        received = torch.empty((self.size, out.numel()), dtype=inp.dtype)
        received[self.rank].copy_(blocks[self.rank])
        works = self._exchange(blocks, received)
        return _finish(_Exchange(works, lambda: reduce_rows(received, out, op, self.size)), async_op)

    def all_gather(self, out, inp, async_op=False):
        """``out: (size*m,)`` gets every peer's ``inp: (m,)`` in group-rank order."""
        # A direct exchange, like reduce_scatter: gloo's allgather moves the same bytes but
        # took 75-109 ms (median 88) for 4 MiB a rank where this takes 71-85 (median 73), and
        # 320-456 ms (374) vs 285-300 (294) for 16 MiB (2x2 emulated nodes, 1gbit, chrt -f 10).
        rows = out.view(self.size, inp.numel())
        rows[self.rank].copy_(inp)
        works = self._exchange([inp] * self.size, rows)
        return _finish(_Exchange(works, None), async_op)

    def _exchange(self, sends, recvs) -> list:
        """Send ``sends[q]`` to and receive ``recvs[q]`` from every peer q but this rank.

        Receives are posted before sends, each on its own: with ``batch_isend_irecv`` the
        reduce-scatter of 4 MiB a rank took 75-143 ms (median 83), with this 75-81 (78), and
        307-578 ms (364) vs 308-330 (322) for 16 MiB, against 70 and 281 ms of TCP goodput
        (2x2 emulated nodes, 1gbit, chrt -f 10). Calls between the same peers match in the
        order they are made (gloo queues sends and receives per peer and tag)."""
        peers = [(q, dist.get_global_rank(self.group, q)) for q in range(self.size) if q != self.rank]
        works = [dist.irecv(recvs[q], g, group=self.group) for q, g in peers]
        return works + [dist.isend(sends[q], g, group=self.group) for q, g in peers]


class _Exchange:
    """Handle of a ``GlooInter`` exchange: ``wait()`` waits for every send and receive, then
    runs ``then`` (the reduction) once."""

    __slots__ = ("_works", "_then")

    def __init__(self, works: list, then: Callable[[], object] | None) -> None:
        self._works, self._then = works, then

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        then, self._then = self._then, None
        if then is not None:
            then()
        return True


def _finish(handle: _Exchange, async_op: bool) -> _Exchange | None:
    if async_op:
        return handle
    handle.wait()
    return None


class Hierarchical:
    """Collectives of one group whose ranks sit on several nodes with the same count each.

    ``shm`` spans this rank's node (None when each node holds one rank), ``inter`` connects
    this rank with its peers on the other nodes: a process group of them (wrapped in
    ``GlooInter``) or any ``InterTransport`` whose ranks are ordered by global rank.
    """

    __slots__ = ("topo", "shm", "inter", "chunk_bytes", "depth", "_inter_pos", "_order")

    def __init__(
        self,
        topo: Topology,
        shm: ShmComm | None,
        inter: dist.ProcessGroup | InterTransport,
        *,
        chunk_bytes: int = 4 << 20,
        depth: int = 2,
    ) -> None:
        if not topo.is_uniform:
            raise ValueError(f"hierarchical collectives need equal nodes, got sizes {topo.node_sizes}")
        if chunk_bytes <= 0 or depth < 1:
            raise ValueError(f"chunk_bytes and depth must be positive, got {chunk_bytes}, {depth}")
        self.topo = topo
        self.shm = shm
        self.inter = GlooInter(inter) if isinstance(inter, dist.ProcessGroup) else inter
        self.chunk_bytes = chunk_bytes
        self.depth = depth
        # The inter group orders peers by global rank, which need not be node order.
        peers = topo.peers(topo.local_rank)
        self._inter_pos = [sorted(peers).index(p) for p in peers]  # node -> inter-group rank
        # _order[l * nodes + q] = group rank of local index l on the node at inter position q
        node_at = {q: j for j, q in enumerate(self._inter_pos)}
        self._order = torch.tensor(
            [topo.ranks_on(node_at[q])[l] for l in range(topo.local_size) for q in range(topo.num_nodes)]
        )

    # ---------------------------------------------------------------- allreduce

    def all_reduce(self, flat: torch.Tensor, op, chunk_bytes: int | None = None) -> None:
        """In place on a contiguous 1-D CPU tensor, in pipelined chunks of ``chunk_bytes``
        (default: the one given at construction)."""
        m_local = self.topo.local_size
        level_op = _LEVEL_OP.get(op, op)
        nbytes = chunk_bytes or self.chunk_bytes
        step = max(m_local, nbytes // flat.element_size() // m_local * m_local)
        pending: deque = deque()
        for lo in range(0, flat.numel(), step):
            chunk = flat[lo:lo + step]
            padded = _pad_to(chunk, m_local)
            shard = torch.empty(padded.numel() // m_local, dtype=flat.dtype)
            self._intra_reduce_scatter(shard, padded, level_op)
            work = self.inter.all_reduce(shard, level_op, async_op=True)
            pending.append((work, shard, chunk, padded))
            if len(pending) > self.depth:
                self._finish_all_reduce(*pending.popleft())
        while pending:
            self._finish_all_reduce(*pending.popleft())
        if op == ReduceOp.AVG:
            flat.div_(self.topo.world_size)

    def _finish_all_reduce(self, work, shard, chunk, padded) -> None:
        work.wait()
        self._intra_all_gather(padded, shard)
        if padded is not chunk:
            chunk.copy_(padded[: chunk.numel()])

    # ---------------------------------------------------------------- reduce-scatter

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op) -> None:
        """``out: (n,)`` contiguous; ``inp: (world * n,)`` contiguous, in group-rank order."""
        n, nodes = out.numel(), self.topo.num_nodes
        level_op = _LEVEL_OP.get(op, op)
        # Regroup blocks as [local index][inter position] so that the intra reduce-scatter
        # leaves each rank the blocks of its peers, in inter-group order.
        regrouped = inp.view(self.topo.world_size, n).index_select(0, self._order)
        mine = torch.empty(nodes * n, dtype=inp.dtype)
        self._intra_reduce_scatter(mine, regrouped.view(-1), level_op)
        if nodes == 1:
            out.copy_(mine)
        else:
            self.inter.reduce_scatter(out, mine, level_op)
        if op == ReduceOp.AVG:
            out.div_(self.topo.world_size)

    # ---------------------------------------------------------------- allgather

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out: (world * n,)`` contiguous gets every rank's ``inp: (n,)`` in group order."""
        n, nodes, m_local = inp.numel(), self.topo.num_nodes, self.topo.local_size
        peers = torch.empty(nodes * n, dtype=inp.dtype)
        self.inter.all_gather(peers, inp.contiguous())
        every = torch.empty(m_local * nodes * n, dtype=inp.dtype)
        self._intra_all_gather(every, peers)
        out.view(self.topo.world_size, n).index_copy_(0, self._order, every.view(m_local * nodes, n))

    # ---------------------------------------------------------------- intra-node steps

    def _intra_reduce_scatter(self, shard, full, op) -> None:
        if self.shm is None:
            shard.copy_(full)
        else:
            self.shm.reduce_scatter(shard, full, op)

    def _intra_all_gather(self, full, shard) -> None:
        if self.shm is None:
            full.copy_(shard)
        else:
            self.shm.all_gather(full, shard)


def _pad_to(chunk: torch.Tensor, multiple: int) -> torch.Tensor:
    """``chunk`` itself if its length is a multiple, else a copy padded with zeros. The
    padding is reduced with padding only, and dropped."""
    extra = -chunk.numel() % multiple
    if not extra:
        return chunk
    padded = torch.zeros(chunk.numel() + extra, dtype=chunk.dtype)
    padded[: chunk.numel()].copy_(chunk)
    return padded
