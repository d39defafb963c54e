"""The routing rule of the core: which path each collective takes.

    local         the group has one rank
    shm           one node: shared-memory CPU-Reduce, or from ``CMA_FROM_BYTES`` on the ranks'
                  own tensors through cross-memory attach where the kernel allows it (``cma``)
    hierarchical  several nodes of equal size: shared memory inside, a transport across
    staged        CUDA tensors on a group without NCCL: pinned host memory, then the above
    stock         everything else: the group's own collective

It is decided in two parts, both from what every rank of a correct program passes alike, so
all ranks route a call the same way:

- ``decide`` needs no communicator: a pure function of the call's device type, the backend
  that serves that device on the group (``backend_of``), the op and the dtype, with the
  group's settings. Every entry point asks it before it builds or uses a communicator (the
  backend, the pool's ``for_call``, the DDP hook, the adapters): a CUDA tensor on a group with
  NCCL goes to the stack's own path, unchanged, its stock ``Work`` handed back as it is, and no
  communicator (shared memory, probes, object collectives) is built for that group. ``refusal``
  adds what only the tensors show (layout, one device for all).
- ``route`` needs the built communicator: its topology, the paths it built, and its plan's
  choice for the call's size (the tuner's measured plan where one is cached; the cost model
  ``tuner.model_plan``, whose size thresholds are ``STOCK_BELOW_BYTES``, is what ``slipstream
  env`` and ``tune`` start from).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from .ops import cannot_reduce, split_op
from .transport.codec import CODECS

__all__ = ["CMA_FROM_BYTES", "DEVICE_LIBRARIES", "ONE_PER_NODE_STOCK_BELOW_BYTES", "STAGED_OVER",
           "STOCK_BELOW_BYTES", "Choice", "Plan", "backend_of", "decide", "keeps", "refusal", "route", "use_cma",
           "wire_format"]

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


DEVICE_LIBRARIES = frozenset({"nccl", "xccl", "hccl"})
"""Backends that are a device's own collective library: they move device tensors device to
device over the device's links, which no staging through host memory beats. A call on one of
them is the stack's own, whatever the tensor."""

STAGED_OVER = frozenset({"gloo", "slipstream"})
"""The backends over which the core takes CUDA tensors (staged through pinned host memory):
the host-memory ones. Any other backend serving CUDA tensors (NCCL, an MPI or UCC built for
CUDA) keeps them."""


def backend_of(group, device_type: str) -> str | None:
    """The backend that serves ``device_type`` tensors on ``group`` (None: WORLD), as torch's
    backend config names it (``"cpu:gloo,cuda:nccl"`` gives ``gloo`` for cpu); None when the
    group has no backend for that device. A group of the ``slipstream`` backend answers for
    itself (``device_backend``: NCCL for CUDA tensors where it built one)."""
    own = getattr(group, "device_backend", None)
    if own is not None:
        return own(device_type)
    try:
        config = dist.get_backend_config(group)
    except (RuntimeError, ValueError):  # not a group torch knows: nothing serves it
        return None
    served = dict(part.split(":", 1) for part in str(config).split(",") if ":" in part)
    return served.get(device_type)


def keeps(device_type: str, backend: str | None) -> str | None:
    """Why a group keeps every call of ``device_type`` tensors on its own backend ``backend``
    whatever the call, the group's size and settings: it has no backend for them, a device's
    own library (NCCL), or a backend for CUDA tensors that is not a host-memory one; or None."""
    if backend is None:
        return f"the group has no backend for {device_type} tensors"
    if backend in DEVICE_LIBRARIES:
        return f"{device_type} tensors on {backend}: the stack's own collective"
    if device_type == "cuda" and backend not in STAGED_OVER:
        return f"CUDA tensors on {backend}: the stack's own collective"
    return None


def decide(device_type: str, backend: str | None, op, dtype: torch.dtype, *, config) -> str | None:
    """The routing decision that needs no communicator: None when the core may take a
    collective of a ``dtype`` tensor on ``device_type`` with ``op`` (an all-gather: SUM, as
    the core moves what it reduces) on a group whose ``device_type`` tensors go to
    ``backend`` (``backend_of``), with settings ``config``; else why the call stays the
    group's own. Pure: the same inputs give the same answer on every rank. The call's size
    and the group's topology decide the rest, once a communicator exists (``route``)."""
    kept = keeps(device_type, backend)
    if kept:
        return kept
    if device_type == "cuda" and not config.cuda_staging:
        return "CUDA staging is disabled"
    if device_type not in ("cpu", "cuda"):
        return f"device {device_type} is not supported"
    if not config.shm:
        return "shared memory is disabled (SLIPSTREAM_SHM=0)"
    base, factor = split_op(op)
    if factor is not None and not dtype.is_floating_point:
        return f"PREMUL_SUM of {dtype} is not defined"
    return cannot_reduce(dtype, base)


def refusal(tensor: torch.Tensor, op=ReduceOp.SUM, others=(), *, config, backend: str | None) -> str | None:
    """Why a collective of ``tensor`` (and ``others``, e.g. its output) with ``op`` cannot take
    a fast path on a group whose tensors of this device go to ``backend``, with settings
    ``config``, or None: ``decide``, then what only the tensors show."""
    why = decide(tensor.device.type, backend, op, tensor.dtype, config=config)
    if why:
        return why
    for t in (tensor, *others):
        if t.layout != torch.strided:
            return f"layout {t.layout} is not supported"
        if t.device != tensor.device:
            return f"tensors on different devices: {tensor.device} and {t.device}"
    return None


def route(kind: str, tensor: torch.Tensor, op, *, world: int, config, backend: str | None, plan: Plan | None,
          hierarchical: bool, intra: bool, unavailable: str,
          one_per_node: bool = False) -> tuple[str, str, Choice | None]:
    """``(algorithm, reason, the plan's choice)`` for ``kind`` of ``tensor`` with ``op`` on a
    group of ``world`` ranks whose communicator built the hierarchical path (``hierarchical``;
    ``one_per_node``: each node holds one of its ranks) or the one-node path (``intra``), or
    neither, for the reason ``unavailable``; ``backend``: what serves the tensor's device on
    the group (``backend_of``). ``tensor``: the allgather's input, the other collectives'
    whole buffer."""
    kept = keeps(tensor.device.type, backend)  # NCCL's even for one rank: its handle orders the streams
    if kept:
        return "stock", kept, None
    if world == 1:
        return "local", "the group has one rank", None
    why = refusal(tensor, op, config=config, backend=backend)
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
