"""The routing rule of the core: which path each collective takes.

    local         the group has one rank
    shm           one node: shared-memory CPU-Reduce, or from ``CMA_FROM_BYTES`` on the ranks'
                  own tensors through cross-memory attach where the kernel allows it (``cma``)
    hierarchical  several nodes of equal size: shared memory inside, a transport across
    staged        CUDA tensors on a group without NCCL: pinned host memory, then the above
    stock         everything else: the group's own collective

``refusal`` needs no communicator: it judges what every rank of a correct program passes alike
(device, dtype, op, layout) and the group's settings; the backend asks it before building a
communicator (a collective), the communicator first on every call. ``route`` needs the built
communicator: its topology, the paths it built, and its plan's choice for the call's size (the
tuner's measured plan where one is cached; the cost model ``tuner.model_plan``, whose size
thresholds are ``STOCK_BELOW_BYTES``, is what ``slipstream env`` and ``tune`` start from). All
of it is what every rank sees alike, so all ranks route a call the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from .ops import cannot_reduce, split_op
from .transport.codec import CODECS

__all__ = ["CMA_FROM_BYTES", "ONE_PER_NODE_STOCK_BELOW_BYTES", "STOCK_BELOW_BYTES", "Choice", "Plan", "refusal",
           "route", "use_cma", "wire_format"]

ReduceOp = dist.ReduceOp

CMA_FROM_BYTES = {"all_reduce": 512 << 10, "reduce_scatter": 256 << 10, "all_gather": 4 << 20}
"""On one node, cross-memory attach from these sizes of the whole buffer (the allreduce's
tensor, the reduce-scatter's input, the allgather's output), where it beat the shared-memory
copies on 1 node x 4 ranks of the benchmark machine: at 256 KiB the allreduce took 0.95 ms
against 0.85, at 512 KiB 1.11 against 1.15; the reduce-scatter 0.58 against 0.62 at 256 KiB;
the allgather 1.06 against 1.03 at 1 MiB and 2.41 against 2.46 at 4 MiB."""

STOCK_BELOW_BYTES = {"all_reduce": 128 << 10, "all_gather": 128 << 10}
"""Across nodes, the stock collective below these full-buffer sizes. From `chrt -f 10
slipstream tune --budget 60` on 2 emulated nodes x 2 ranks at 1 Gbit/s (2-core KVM guest;
benchmarks/results/tuner_*.md): stock's one ring beat hierarchical's three phases up to
64 KiB (allreduce 0.80 vs 1.16 ms at 4 KiB, 0.99 vs 1.51 at 64 KiB; allgather 0.80 vs 1.28 at
64 KiB), tied at 256 KiB (3.09 vs 3.17) and lost above (1 MiB: 11.3 vs 14.4 ms). The
reduce-scatter gap was within noise (4 KiB: 0.83 vs 0.93 ms): hierarchical at every size.
A config's ``min_hierarchical_bytes`` raises these."""


ONE_PER_NODE_STOCK_BELOW_BYTES = {"all_reduce": 4 << 20, "all_gather": 1 << 20, "reduce_scatter": 256 << 10}
"""With one rank per node, and no plan, the stock collective below these full-buffer sizes. There
is no stage inside a node then: the hierarchical path is the stock exchange between the nodes
plus its own per-call work. `slipstream bench comm --nodes 2 --ranks-per-node 1 --link 1gbit
--iters 20` (medians of 3, benchmarks/results/comm_2node_*.md), hierarchical against gloo: the
allreduce 0.86x-1.07x up to 1 MiB, 1.02x at 4 and 16 MiB; the allgather 0.59x-0.98x up to 1 MiB,
1.19x at 4 MiB; the reduce-scatter 0.73x-0.85x up to 64 KiB, 1.58x at 256 KiB (gloo's costs a
whole allreduce). The allgather's was 4 MiB too, until gloo's own (it gathers into a new buffer
and copies out) was found to leave glibc's heaps fragmented: in a 2-node soak, every growth of
the heaps after the 1,000th call came from 1-4 MiB allgathers on one-rank-per-node groups. With
the hierarchical path's chunks in place and its temporaries in arenas, it is the faster from
1 MiB: 1.19x, 1.24x, 1.28x, 1.37x gloo at 1, 2, 3, 4 MiB (2 x 1 ranks, AMD EPYC, medians of 3,
benchmarks/results/faults_*.md). Not where a ``wire`` format makes the message smaller. A
config's ``min_hierarchical_bytes`` raises these; a tuned plan replaces them."""


@dataclass(frozen=True)
class Choice:
    """What a plan picks for one (collective, size, dtype)."""

    algorithm: str
    """'stock', 'shm' or 'hierarchical'; one the topology does not allow is ignored."""
    chunk_bytes: int | None = None
    """Chunk of the hierarchical pipeline for this call; None keeps the config's."""


class Plan(Protocol):
    """Per-call choices, e.g. measured by the tuner. None means: the built-in rules."""

    def choose(self, kind: str, nbytes: int, dtype: torch.dtype) -> Choice | None: ...


def refusal(tensor: torch.Tensor, op=ReduceOp.SUM, others=(), *, config, nccl: bool) -> str | None:
    """Why a collective of ``tensor`` (and ``others``, e.g. its output) with ``op`` cannot take
    a fast path on a group with settings ``config`` (``nccl``: the group has NCCL for CUDA
    tensors), or None."""
    if tensor.device.type == "cuda":
        if nccl:
            return "CUDA tensor on a group with NCCL"  # NCCL beats staging through host memory
        if not config.cuda_staging:
            return "CUDA staging is disabled"
    if not config.shm:
        return "shared memory is disabled (SLIPSTREAM_SHM=0)"
    if tensor.device.type not in ("cpu", "cuda"):
        return f"device {tensor.device} is not supported"
    for t in (tensor, *others):
        if t.layout != torch.strided:
            return f"layout {t.layout} is not supported"
        if t.device != tensor.device:
            return f"tensors on different devices: {tensor.device} and {t.device}"
    base, factor = split_op(op)
    if factor is not None and not tensor.dtype.is_floating_point:
        return f"PREMUL_SUM of {tensor.dtype} is not defined"
    return cannot_reduce(tensor.dtype, base)


def route(kind: str, tensor: torch.Tensor, op, *, world: int, config, nccl: bool, plan: Plan | None,
          hierarchical: bool, intra: bool, unavailable: str,
          one_per_node: bool = False) -> tuple[str, str, Choice | None]:
    """``(algorithm, reason, the plan's choice)`` for ``kind`` of ``tensor`` with ``op`` on a
    group of ``world`` ranks whose communicator built the hierarchical path (``hierarchical``;
    ``one_per_node``: each node holds one of its ranks) or the one-node path (``intra``), or
    neither, for the reason ``unavailable``. ``tensor``: the allgather's input, the other
    collectives' whole buffer."""
    if world == 1:
        return "local", "the group has one rank", None
    why = refusal(tensor, op, config=config, nccl=nccl)
    if why:
        return "stock", why, None
    nbytes = tensor.numel() * tensor.element_size()
    choice = plan.choose(kind, nbytes, tensor.dtype) if plan is not None else None
    by_size = _stock_gives_the_same(kind, tensor, op)  # only then may speed alone choose stock
    if by_size and choice is not None and choice.algorithm == "stock":
        return "stock", f"the plan ({getattr(plan, 'source', 'given')}) chose the stock collective", choice
    if choice is not None and choice.algorithm == "stock":
        choice = None
    staged = tensor.device.type == "cuda"
    if hierarchical:
        if by_size and choice is None:
            full = nbytes * world if kind == "all_gather" else nbytes
            if (one_per_node and full < ONE_PER_NODE_STOCK_BELOW_BYTES[kind]
                    and wire_format(kind, tensor, op, config=config, nbytes=full) == "full"):
                return "stock", (f"one rank per node: the stock {kind} below "
                                 f"{ONE_PER_NODE_STOCK_BELOW_BYTES[kind]} bytes"), None
            if nbytes < config.min_hierarchical_bytes:
                return "stock", f"{nbytes} bytes is below min_hierarchical_bytes", None
        return ("staged" if staged else "hierarchical"), "", choice
    if intra:
        return ("staged" if staged else "shm"), "", choice
    return "stock", unavailable or "no fast path for this topology", choice


def _stock_gives_the_same(kind: str, tensor: torch.Tensor, op) -> bool:
    """Whether the stock collective computes what the fast paths do, so that a size threshold
    may send the call there: an all-gather (no arithmetic), or a plain SUM of a float32/float64
    or integer tensor. gloo refuses AVG and PREMUL_SUM, its MAX/MIN drop NaNs the core keeps,
    and the core sums fp16/bf16 in fp32."""
    if kind == "all_gather":
        return True
    base, factor = split_op(op)
    return base == ReduceOp.SUM and factor is None and tensor.dtype not in (torch.float16, torch.bfloat16)


def use_cma(kind: str, nbytes: int) -> bool:
    """Whether a one-node ``kind`` of a buffer of ``nbytes`` (the larger of output and input)
    goes through cross-memory attach, where the communicator has it."""
    return nbytes >= CMA_FROM_BYTES[kind]


def wire_format(kind: str, tensor: torch.Tensor, op, *, config, nbytes: int) -> str:
    """The cross-node format of a hierarchical ``kind`` of ``tensor`` with ``op`` (not read for
    an all-gather) moving ``nbytes`` in all: ``config.wire`` for an all-gather or a SUM/AVG (also
    PREMUL_SUM) reduction of a dtype that format makes smaller, of ``config.wire_min_bytes`` or
    more; else ``"full"``. MAX, MIN and PRODUCT, integers and small messages are never rounded."""
    codec = CODECS.get(config.wire)
    if codec is None or nbytes < config.wire_min_bytes or tensor.dtype not in codec.dtypes:
        return "full"
    if kind != "all_gather" and split_op(op)[0] not in (ReduceOp.SUM, ReduceOp.AVG):
        return "full"
    return config.wire
