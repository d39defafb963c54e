"""Hierarchical collectives: shared memory inside the node, an ``InterTransport`` across nodes
between each local rank and its peers (the ranks of the same local index on the other nodes),
all local ranks in parallel.

allreduce      = intra reduce-scatter -> inter allreduce of the shard -> intra allgather
reduce-scatter = intra reduce-scatter (of each node's blocks) -> inter reduce-scatter
allgather      = inter allgather -> intra allgather (then blocks put back in group order)

All three are pipelined by chunk: the inter-node exchange of chunk k (gloo's or the
transport's threads) overlaps the intra-node work of chunk k+1 (this thread). A chunk of a
reduce-scatter or allgather is the same column range of every block, so blocks still go to
the ranks of their local index and every element is reduced in the same order whatever the
chunk size. Each node sends its data across its link once per other node's share, the least
possible: for 2 nodes, an allreduce of S bytes sends S out of each node, where a flat ring
over all ranks sends 2(W-1)/W * S across the link its ring crosses.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from .. import counters
from ..ops import level_op as level_op_of
from ..scratch import Scratch
from ..topology import Topology
from ..transport import InterTransport
from ..transport.gloo import GlooInter
from .shm import ShmComm

__all__ = ["Hierarchical"]

ReduceOp = dist.ReduceOp


class Hierarchical:
    """Collectives of one group whose ranks sit on several nodes with the same count each.
    ``shm`` spans this rank's node (None when each node holds one rank), ``inter`` connects
    this rank with its peers on the other nodes: a process group of them (wrapped in
    ``GlooInter``) or any ``InterTransport`` whose ranks are ordered by global rank.
    """

    __slots__ = ("topo", "shm", "inter", "chunk_bytes", "depth", "scratch", "_inter_pos", "_order", "_node_rows")

    def __init__(self, topo: Topology, shm: ShmComm | None, inter: dist.ProcessGroup | InterTransport, *,
                 chunk_bytes: int = 4 << 20, depth: int = 2) -> None:
        if not topo.is_uniform:
            raise ValueError(f"hierarchical collectives need equal nodes, got sizes {topo.node_sizes}")
        if chunk_bytes <= 0 or depth < 1:
            raise ValueError(f"chunk_bytes and depth must be positive, got {chunk_bytes}, {depth}")
        self.topo = topo
        self.shm = shm
        self.inter = GlooInter(inter) if isinstance(inter, dist.ProcessGroup) else inter
        self.chunk_bytes = chunk_bytes
        self.depth = depth
        self.scratch = Scratch(depth + 1)  # the temporaries of the chunks in flight, kept across calls
        # The inter group orders peers by global rank, which need not be node order.
        peers = topo.peers(topo.local_rank)
        self._inter_pos = [sorted(peers).index(p) for p in peers]  # node -> inter-group rank
        # _order[l * nodes + q] = group rank of local index l on the node at inter position q
        node_at = {q: j for j, q in enumerate(self._inter_pos)}
        self._order = torch.tensor(
            [topo.ranks_on(node_at[q])[l] for l in range(topo.local_size) for q in range(topo.num_nodes)]
        )
        # _node_rows[q]: the blocks of the ranks on the node at inter position q, in
        # local-index order: the rows one intra reduce-scatter gives out to the local ranks.
        self._node_rows = [_rows(topo.ranks_on(node_at[q])) for q in range(topo.num_nodes)]

    def held_bytes(self) -> int:
        """Its chunks' arenas."""
        return self.scratch.nbytes

    def all_reduce(self, flat: torch.Tensor, op, chunk_bytes: int | None = None,
                   inter: InterTransport | None = None) -> None:
        """In place on a contiguous 1-D CPU tensor, in pipelined chunks of ``chunk_bytes``
        (default: the one given at construction). ``inter``: the exchange across nodes for this
        call (default: the one given at construction; e.g. a lossy ``WireInter``)."""
        m_local, nodes = self.topo.local_size, self.topo.num_nodes
        inter = inter or self.inter
        level_op = level_op_of(op)
        nbytes = chunk_bytes or self.chunk_bytes
        step = max(m_local, nbytes // flat.element_size() // m_local * m_local)

        def start(numbered):
            k, (lo, hi) = numbered
            take = self._begin(k)
            chunk = flat[lo:hi]
            padded = _pad_to(chunk, m_local, take)
            if self.shm is None:  # one rank per node: the chunk itself crosses, in place
                shard = padded
            else:
                shard = take(padded.numel() // m_local, flat.dtype)
                self.shm.reduce_scatter(shard, padded, level_op)
            if hasattr(inter, "payload_bytes"):  # a lossy format: its payload to every other node
                counters.add_link((nodes - 1) * inter.payload_bytes(shard.numel()))
            else:  # the least any allreduce sends across: 2(n-1)/n of the shard (one exchange for 2)
                counters.add_link(2 * (nodes - 1) * shard.numel() * shard.element_size() // nodes)
            return inter.all_reduce(shard, level_op, async_op=True, scratch=take), shard, chunk, padded

        self._pipelined(map(start, enumerate(_ramped(flat.numel(), step, m_local))), self._finish_all_reduce)
        if op == ReduceOp.AVG:
            flat.div_(self.topo.world_size)

    def _finish_all_reduce(self, started) -> None:
        work, shard, chunk, padded = started
        work.wait()
        if self.shm is not None:
            self.shm.all_gather(padded, shard)
        if padded is not chunk:
            chunk.copy_(padded[: chunk.numel()])

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op, chunk_bytes: int | None = None,
                       valid: list[int] | None = None, inter: InterTransport | None = None) -> None:
        """``out: (n,)`` contiguous; ``inp: (world * n,)`` contiguous, in group-rank order.
        In pipelined chunks of about ``chunk_bytes`` of ``inp`` (default: the one given at
        construction), each the same columns of every block. ``valid[r]``: the leading
        elements of rank r's block that matter (the rest is zero padding): only those cross
        the link. ``inter``: as for ``all_reduce``."""
        n, nodes = out.numel(), self.topo.num_nodes
        level_op = level_op_of(op)
        inter = inter or self.inter
        blocks = inp.view(self.topo.world_size, n)
        owners = self._order.view(self.topo.local_size, nodes)[self.topo.local_rank].tolist()  # of my peers' blocks

        def start(numbered):
            k, cols = numbered
            take = self._begin(k)
            # mine[q]: the sum over this node's ranks of the block of this rank's peer at
            # inter position q. One intra reduce-scatter per node, straight from the input's
            # blocks (a strided view): regrouping the whole input into one call cost a copy
            # of it, 37-43 ms a rank for 64 MiB on 2x2 emulated nodes.
            mine = take(nodes * (cols.stop - cols.start), inp.dtype)
            if self.shm is None:
                torch.index_select(blocks[:, cols], 0, self._order, out=mine.view(nodes, -1))
            else:
                for q, part in enumerate(mine.view(nodes, -1)):
                    self.shm.reduce_scatter(part, _select(blocks, self._node_rows[q], cols, take), level_op)
            if nodes == 1:
                out[cols].copy_(mine)
                return None, mine
            width = cols.stop - cols.start
            lengths = None if valid is None else [min(width, max(0, valid[g] - cols.start)) for g in owners]
            sent = [width] * nodes if lengths is None else lengths
            sent = sent[: self._inter_pos[self.topo.node]] + sent[self._inter_pos[self.topo.node] + 1:]
            counters.add_link(sum(_link_bytes(inter, k, inp.element_size()) for k in sent))
            return inter.reduce_scatter(out[cols], mine, level_op, async_op=True, lengths=lengths, scratch=take), mine

        self._pipelined(map(start, enumerate(self._columns(n, inp.element_size(), chunk_bytes))), _wait)
        if op == ReduceOp.AVG:
            out.div_(self.topo.world_size)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, chunk_bytes: int | None = None,
                   inter: InterTransport | None = None) -> None:
        """``out: (world * n,)`` contiguous gets every rank's ``inp: (n,)`` in group order.
        In pipelined chunks of about ``chunk_bytes`` of ``out``, each the same columns of
        every block. ``inp`` may be a view into ``out``: chunk k rewrites only columns whose
        input was sent before, with the values they already hold. ``inter``: as for
        ``all_reduce``."""
        n, nodes = inp.numel(), self.topo.num_nodes
        inter = inter or self.inter
        rows = out.view(self.topo.world_size, n)

        def start(numbered):
            k, cols = numbered
            take = self._begin(k)
            if nodes == 1:
                return None, inp[cols], cols, take
            peers = take(nodes * (cols.stop - cols.start), inp.dtype)
            counters.add_link((nodes - 1) * _link_bytes(inter, cols.stop - cols.start, inp.element_size()))
            return inter.all_gather(peers, inp[cols], async_op=True), peers, cols, take

        def finish(started) -> None:
            _wait(started)
            _, peers, cols, take = started
            every = peers
            if self.shm is not None:
                every = take(self.topo.local_size * peers.numel(), inp.dtype)
                self.shm.all_gather(every, peers)
            rows[:, cols].index_copy_(0, self._order, every.view(self.topo.world_size, -1))

        self._pipelined(map(start, enumerate(self._columns(n, inp.element_size(), chunk_bytes))), finish)

    def _pipelined(self, started: Iterable, finish: Callable) -> None:
        """``_pipeline`` at this path's depth. Should a chunk fail, the exchanges of the chunks
        after it may still be in flight, writing into their slots: later calls get new arenas."""
        try:
            _pipeline(started, finish, self.depth)
        except BaseException:
            self.scratch = Scratch(self.depth + 1)
            raise

    def _begin(self, k: int):
        """Chunk ``k`` of a call starts: the function giving its temporaries (``scratch``). The
        pipeline has finished chunk ``k - depth - 1`` by then, whose slot this is."""
        self.scratch.begin(k)
        return self.scratch.taker(k)

    def _columns(self, n: int, itemsize: int, chunk_bytes: int | None) -> list[slice]:
        """Column ranges of blocks of ``n`` elements: each chunk holds about ``chunk_bytes``
        of the world's blocks, at least one column."""
        width = max(1, (chunk_bytes or self.chunk_bytes) // (itemsize * self.topo.world_size))
        return [slice(a, min(n, a + width)) for a in range(0, n, width)]


def _pipeline(started: Iterable, finish: Callable, depth: int) -> None:
    """``finish`` every item of ``started`` in order; the next ``depth`` items are started
    (their inter-node exchanges in flight) before an item is finished."""
    pending: deque = deque()
    for item in started:
        pending.append(item)
        if len(pending) > depth:
            finish(pending.popleft())
    while pending:
        finish(pending.popleft())


def _ramped(n: int, step: int, unit: int) -> list[tuple[int, int]]:
    """Chunk bounds ``(lo, hi)`` over ``n`` elements: ``step`` each, but the first two and the
    last two ramp (step/4, step/2, ..., step/2, step/4), so that the link starts sooner and
    the last intra-node allgather is shorter. Every chunk but the last is a multiple of
    ``unit``. 16 MiB allreduce on 2x2 emulated nodes at 1gbit: 154 ms
    against 161-169 with equal 4 MiB chunks (chrt -f 10; the link bound is 134)."""
    small = [max(unit, step // k // unit * unit) for k in (4, 2)]
    head: list[int] = []
    for size in small:
        if sum(head) + size < n:
            head.append(size)
    left = n - sum(head)
    tail: list[int] = []
    for size in small:
        if left - size > step:
            tail.insert(0, size)
            left -= size
    rem = left % step
    body = [step] * (left // step) + ([rem // unit * unit] if rem >= unit else [])
    sizes = head + body + tail
    odd = rem - rem // unit * unit  # fewer than ``unit`` elements: onto the last chunk
    if odd:
        sizes = sizes[:-1] + [sizes[-1] + odd] if sizes else [odd]
    bounds, lo = [], 0
    for size in sizes:
        bounds.append((lo, lo + size))
        lo += size
    return bounds


def _wait(started) -> None:
    """Finish a started chunk whose first field is its inter-node handle (None: nothing)."""
    if started[0] is not None:
        started[0].wait()


def _link_bytes(inter, n: int, itemsize: int) -> int:
    """Bytes ``n`` elements take on the link through ``inter`` (fewer in a lossy format)."""
    return inter.payload_bytes(n) if hasattr(inter, "payload_bytes") else n * itemsize


def _rows(ranks: tuple[int, ...]) -> slice | torch.Tensor:
    """A slice over ``ranks`` where they are evenly spaced (a view, no copy), else an index."""
    step = ranks[1] - ranks[0] if len(ranks) > 1 else 1
    if all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return slice(ranks[0], ranks[-1] + 1, step)
    return torch.tensor(ranks)


def _select(blocks: torch.Tensor, rows: slice | torch.Tensor, cols: slice, take) -> torch.Tensor:
    """``blocks[rows, cols]``: a view for a slice of rows, a copy in ``take(numel, dtype)`` for
    an index."""
    if isinstance(rows, slice):
        return blocks[rows, cols]
    into = take(rows.numel() * (cols.stop - cols.start), blocks.dtype).view(rows.numel(), -1)
    return torch.index_select(blocks[:, cols], 0, rows, out=into)


def _pad_to(chunk: torch.Tensor, multiple: int, take) -> torch.Tensor:
    """``chunk`` itself if its length is a multiple, else a copy padded with zeros (in
    ``take(numel, dtype)``). The padding is reduced with padding only, and dropped."""
    extra = -chunk.numel() % multiple
    if not extra:
        return chunk
    padded = take(chunk.numel() + extra, chunk.dtype)
    padded[: chunk.numel()].copy_(chunk)
    padded[chunk.numel():].zero_()
    return padded
