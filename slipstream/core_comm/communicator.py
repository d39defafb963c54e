"""The communicator every adapter calls: one per process group.

It picks an algorithm per call from the size, dtype, device and op of the tensors and the
topology of the group:

    local         the group has one rank
    shm           one node: shared-memory CPU-Reduce, or from ``cma.MIN_BYTES`` on the ranks'
                  own tensors through cross-memory attach where the kernel allows it
    hierarchical  several nodes of equal size: shared memory inside, stock backend across
    staged        CUDA tensors on a group without NCCL: pinned host memory, then the above
    stock         everything else: the group's own collective, with a debug log line saying why

The choice depends only on what every rank sees alike, so all ranks choose the same.

The routing rule lives here, and the backend asks it (``refusal``) before it builds a
communicator: ops SUM, AVG (floating dtypes), PREMUL_SUM (scale, then SUM), PRODUCT, MAX and
MIN with gloo's semantics, on CPU (or staged CUDA) tensors of the shared-memory dtypes,
strided, all on one device. The coalesced forms (``all_reduce_coalesced``, coalesced
reduce-scatter and all-gather) run as one operation over one flat buffer. Every call is
counted under the path it took (``counters``).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from . import counters
from .call_check import CallCheck, describe
from ._compat import all_gather_into_tensor, reduce_scatter_tensor
from .collectives.cma import MIN_BYTES as CMA_MIN_BYTES, CmaComm
from .config import CommConfig
from .groups import group_ranks, node_subgroups
from .collectives.hierarchical import Hierarchical
from .routing import check_coalesced, chain, refusal, split_op, unflatten
from .collectives.shm import ShmComm, ShmError, _check_sizes, is_supported_platform
from .collectives.staging import CudaStaging
from .topology import Topology, detect_topology

__all__ = ["Choice", "Communicator", "Plan", "Work", "as_torch_future"]

log = logging.getLogger("slipstream.comm")
ReduceOp = dist.ReduceOp


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


class Work:
    """Handle of an asynchronous collective, like torch.distributed's ``Work``."""

    __slots__ = ("_future",)

    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self, timeout=None) -> bool:
        """Block until done; ``timeout`` (seconds or a timedelta) raises TimeoutError."""
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        self._future.result(timeout=seconds)
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> Future:
        return self._future


class Communicator:
    """Fast collectives over ``group`` (None: the default group). Construction is collective."""

    __slots__ = (
        "group", "config", "plan", "rank", "world", "topology",
        "shm", "cma", "hier", "unavailable",  # built algorithms, and why the others are not
        "_staging", "_executor", "_last", "checker",
    )

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        config: CommConfig | None = None,
        topology: Topology | None = None,
        plan: Plan | None = None,
        checker: CallCheck | None = None,
    ) -> None:
        self.group = group
        self.checker = checker
        """``SLIPSTREAM_DEBUG``'s same-call check (built on the first checked call if None)."""
        self.config = config if config is not None else CommConfig.from_env()
        self.plan = plan
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.topology = topology if topology is not None else detect_topology(group)
        self.shm: ShmComm | None = None
        self.cma: CmaComm | None = None
        self.hier: Hierarchical | None = None
        self.unavailable = self._build()
        self._staging: dict = {}
        self._executor: ThreadPoolExecutor | None = None
        self._last: Future | None = None

    # ---------------------------------------------------------------- set-up

    def _build(self) -> str:
        """Build what the topology allows; return why the fast paths are off, or ''."""
        cfg, topo = self.config, self.topology
        if self.world == 1:
            return ""
        if not cfg.shm:
            return "shared memory is disabled (SLIPSTREAM_SHM=0)"
        if not is_supported_platform():
            return "shared-memory collectives need x86-64 Linux"
        if topo.num_nodes > 1 and not cfg.hierarchical:
            return "hierarchical collectives are disabled (SLIPSTREAM_HIERARCHICAL=0)"
        if topo.num_nodes > 1 and not topo.is_uniform:
            return f"nodes hold different numbers of ranks {topo.node_sizes}"
        if topo.num_nodes > 1 and group_ranks(self.group) != sorted(group_ranks(self.group)):
            return "the group's ranks are not in global-rank order"
        intra, inter = node_subgroups(self.group, topo, timedelta(seconds=cfg.timeout_s))
        try:
            if intra is not None:
                self.shm = ShmComm(intra, slot_bytes=cfg.slot_bytes, small_bytes=cfg.small_bytes,
                                   timeout=cfg.timeout_s)
        except ShmError as e:
            return f"shared memory could not be set up: {e}"
        if inter is None and cfg.cma:
            try:
                self.cma = CmaComm(self.shm)
            except ShmError as e:  # the same on every rank: all keep the shared-memory path
                log.debug("slipstream: no cross-memory attach on this node: %s", e)
        if inter is not None:
            self.hier = Hierarchical(topo, self.shm, self._inter_transport(inter), chunk_bytes=cfg.chunk_bytes)
        return ""

    def _inter_transport(self, inter: dist.ProcessGroup):
        if self.config.connections == 1:
            return inter
        from .transport.tcp import MultiConnInter  # collective over ``inter``

        cfg = self.config
        ports = range(cfg.port_base, 65536) if cfg.port_base else None
        return MultiConnInter(inter, connections=cfg.connections, timeout_s=cfg.timeout_s, ports=ports)

    def close(self) -> None:
        self._drain()
        if self._executor is not None:
            self._executor.shutdown()
        if self.shm is not None:
            self.shm.close()
        self.cma = None
        inter = self.hier.inter if self.hier is not None else None
        if hasattr(inter, "close"):  # a multi-connection transport's sockets and threads
            inter.close()

    # ---------------------------------------------------------------- routing

    def algorithm(self, tensor: torch.Tensor, op=ReduceOp.SUM, kind: str = "all_reduce") -> tuple[str, str]:
        """``(algorithm, reason)`` this communicator uses for ``kind`` on ``tensor`` and ``op``."""
        algo, why, _ = self._route(kind, tensor, op)
        return algo, why

    def _route(self, kind: str, tensor: torch.Tensor, op) -> tuple[str, str, Choice | None]:
        """``(algorithm, reason, the plan's choice)``. A plan's answer overrides the
        config's ``min_hierarchical_bytes`` (the tuner measured or modelled that size)."""
        choice = None
        if self.world == 1:
            return "local", "the group has one rank", choice
        if tensor.device.type == "cuda":
            if not self.config.cuda_staging:
                return "stock", "CUDA staging is disabled", choice
            if "nccl" in str(dist.get_backend(self.group)):
                return "stock", "CUDA tensor on a group with NCCL", choice
        reason = refusal(tensor, op)
        if reason:
            return "stock", reason, choice
        nbytes = tensor.numel() * tensor.element_size()
        choice = self.plan.choose(kind, nbytes, tensor.dtype) if self.plan is not None else None
        if choice is not None and choice.algorithm == "stock":
            return "stock", f"the plan ({getattr(self.plan, 'source', 'given')}) chose the stock collective", choice
        staged = tensor.device.type == "cuda"
        if self.hier is not None:
            if choice is None and nbytes < self.config.min_hierarchical_bytes:
                return "stock", f"{nbytes} bytes is below min_hierarchical_bytes", choice
            return ("staged" if staged else "hierarchical"), "", choice
        if self.shm is not None:
            return ("staged" if staged else "shm"), "", choice
        return "stock", self.unavailable or "no fast path for this topology", choice

    def _choose(self, kind: str, tensor: torch.Tensor, op, others=(), nbytes: int | None = None):
        """``(algorithm, plan choice, path label)`` for this call, counted under the label."""
        for other in others:
            if other.device != tensor.device:
                raise ValueError(f"{kind}: tensors on different devices: {tensor.device} and {other.device}")
        if self.config.debug:
            self._check_same_call(kind, tensor, op)
        algo, why, choice = self._route(kind, tensor, op)
        if algo == "stock":
            log.debug("slipstream %s of %s %s (%s): stock collective: %s",
                      kind, tuple(tensor.shape), tensor.dtype, op, why)
        nbytes = tensor.numel() * tensor.element_size() if nbytes is None else nbytes
        label = algo
        if algo == "shm" and self._intra(kind, nbytes) is self.cma:
            label = "cma"
        return algo, choice, label

    def _check_same_call(self, kind, tensor, op) -> None:
        if self.checker is None:
            self.checker = CallCheck.for_group(self.group, self.config.timeout_s)
        self.checker.check(describe(kind, tensor, op))

    # ---------------------------------------------------------------- collectives

    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False):
        """In place, like ``dist.all_reduce``; returns a ``Work`` when ``async_op``."""
        return self._all_reduce_as("all_reduce", tensor, op, async_op)

    def _all_reduce_as(self, counted: str, tensor: torch.Tensor, op, async_op: bool):
        algo, choice, label = self._choose("all_reduce", tensor, op)
        with counters.record(counted, label, tensor.numel() * tensor.element_size()):
            if algo == "stock":
                return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)
            chunk = choice.chunk_bytes if choice is not None else None
            return self._run(lambda: self._all_reduce(algo, tensor, op, chunk), async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                       async_op: bool = False):
        """Like ``dist.reduce_scatter_tensor``: ``input`` holds ``world`` blocks of ``output``'s size."""
        return self._resize_as("reduce_scatter", "reduce_scatter", output, input, op, async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Like ``dist.all_gather_into_tensor``; ``input`` may be a view into ``output``."""
        return self._resize_as("all_gather", "all_gather", output, input, None, async_op)

    def _resize_as(self, counted: str, kind: str, output, input, op, async_op: bool):
        _check_sizes(kind, output, input, self.world)
        big = output if kind == "all_gather" else input
        nbytes = big.numel() * big.element_size()
        algo, _, label = self._choose(kind, input, ReduceOp.SUM if op is None else op, (output,), nbytes)
        with counters.record(counted, label, nbytes):
            if algo == "stock" and kind == "all_gather":
                return all_gather_into_tensor(output, input, group=self.group, async_op=async_op)
            if algo == "stock":
                return reduce_scatter_tensor(output, input, op=op, group=self.group, async_op=async_op)
            return self._run(lambda: self._resize(kind, algo, output, input, op), async_op)

    # The coalesced forms: one operation over one flat buffer, so a bucket of many small
    # tensors costs one synchronisation instead of one per tensor.

    def all_reduce_coalesced(self, tensors: list, op=ReduceOp.SUM, async_op: bool = False):
        """``all_reduce`` of each tensor (same dtype and device), as one call."""
        check_coalesced("all_reduce_coalesced", tensors)
        flat = torch.cat([t.reshape(-1) for t in tensors])
        work = self._all_reduce_as("all_reduce_coalesced", flat, op, async_op)
        return self._then(work, lambda: unflatten(flat, tensors))

    def reduce_scatter_coalesced(self, outputs: list, inputs: list, op=ReduceOp.SUM, async_op: bool = False):
        """``reduce_scatter`` of each pair, as one call: the inputs' rank-r blocks are laid
        side by side, so rank r receives its blocks of every input in one shard."""
        check_coalesced("reduce_scatter_coalesced", inputs, outputs)
        for o, i in zip(outputs, inputs):
            _check_sizes("reduce_scatter", o, i, self.world)
        flat_in = torch.cat([i.reshape(self.world, -1) for i in inputs], dim=1).reshape(-1)
        flat_out = flat_in.new_empty(flat_in.numel() // self.world)
        work = self._resize_as("reduce_scatter_coalesced", "reduce_scatter", flat_out, flat_in, op, async_op)
        return self._then(work, lambda: unflatten(flat_out, outputs))

    def all_gather_coalesced(self, outputs: list, inputs: list, async_op: bool = False):
        """``all_gather`` of each pair, as one call."""
        check_coalesced("all_gather_coalesced", inputs, outputs)
        for o, i in zip(outputs, inputs):
            _check_sizes("all_gather", o, i, self.world)
        flat_in = torch.cat([i.reshape(-1) for i in inputs])
        flat_out = flat_in.new_empty(flat_in.numel() * self.world)

        def scatter_back() -> None:
            rows = flat_out.view(self.world, -1)
            at = 0
            for o, i in zip(outputs, inputs):
                o.view(self.world, -1).copy_(rows[:, at:at + i.numel()])
                at += i.numel()

        work = self._resize_as("all_gather_coalesced", "all_gather", flat_out, flat_in, None, async_op)
        return self._then(work, scatter_back)

    @staticmethod
    def _then(work, finish):
        """Run ``finish`` after ``work`` (None: the call was synchronous and is done)."""
        if work is None:
            finish()
            return None
        return Work(chain(work, finish))

    # ---------------------------------------------------------------- execution

    def _run(self, fn, async_op: bool):
        """Run ``fn`` now, or on the worker thread (``async_op``). A collective reduces values,
        as gloo's does: outside autograd, also for a tensor that requires grad (DDP under
        ``backward(create_graph=True)``), where an ``out=`` reduction would raise."""

        def values_only() -> None:
            try:
                with torch.no_grad():
                    fn()
            except Exception as e:  # noqa: BLE001 - re-raised with the job's first failure
                raise _with_first_failure(e) from e

        if not async_op:
            self._drain()  # keep the order of calls the same on every rank
            values_only()
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="slipstream-comm")
        self._last = self._executor.submit(values_only)
        return Work(self._last)

    def _drain(self) -> None:
        """Wait for the last async call (calls run in order on every rank). Its error belongs
        to its own ``Work``, not to the next call: a broken group (a dead or mismatched peer)
        refuses every later call by itself."""
        if self._last is not None:
            futures_wait([self._last])
            self._last = None

    def _intra(self, kind: str, nbytes: int):
        """The one-node implementation of ``kind`` for a buffer of ``nbytes`` (the larger of
        output and input): the same on every rank."""
        return self.cma if self.cma is not None and nbytes >= CMA_MIN_BYTES[kind] else self.shm

    def _cpu_all_reduce(self, flat: torch.Tensor, op, chunk_bytes: int | None) -> None:
        nbytes = flat.numel() * flat.element_size()
        if self.hier is None:
            self._intra("all_reduce", nbytes).all_reduce(flat, op)
            return
        if chunk_bytes is None:
            # A quarter of the message, never less than chunk_bytes: each chunk costs a
            # synchronisation of every rank, which under the default scheduler (4 ranks and the
            # link's network work on 2 cores) waits for a rank to be scheduled. 64 MiB on 2x2
            # emulated nodes at 1 Gbit/s: 16 MiB chunks 814-874 ms, 4 MiB 992-1025 ms, 1 MiB
            # 994-1108 ms (benchmarks/results/comm_*.md). 16 MiB messages keep 4 MiB chunks.
            chunk_bytes = max(self.config.chunk_bytes, nbytes // 4 // 64 * 64)
        self.hier.all_reduce(flat, op, chunk_bytes=chunk_bytes)

    def _all_reduce(self, algo, tensor, op, chunk_bytes) -> None:
        op, factor = split_op(op)
        if factor is not None:
            tensor.mul_(factor)
        if algo == "local":
            return
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        if algo == "staged":
            self._stager(tensor.device).all_reduce(work, lambda host: self._cpu_all_reduce(host, op, chunk_bytes))
        else:
            self._cpu_all_reduce(work.view(-1), op, chunk_bytes)
        if work is not tensor:
            tensor.copy_(work)

    def _resize(self, kind, algo, output, input, op) -> None:
        """Reduce-scatter or allgather (``kind``): collectives whose output and input differ
        in size by the world size."""
        if op is not None:
            op, factor = split_op(op)
            if factor is not None:  # the caller's input stays as it was, as with NCCL
                input = input * factor
        if algo == "local":
            output.copy_(input.view_as(output))
        elif algo == "staged":
            host_out = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
            cpu_algo = "hierarchical" if self.hier else "shm"
            self._resize(kind, cpu_algo, host_out, self._stager(input.device).to_host(input), op)
            output.copy_(host_out)
        elif algo == "shm":
            big = max(input.numel(), output.numel()) * input.element_size()
            _invoke(self._intra(kind, big), kind, output, input, op)
        else:
            out = output if output.is_contiguous() else torch.empty_like(output)
            _invoke(self.hier, kind, out.view(-1), input.reshape(-1), op)
            if out is not output:
                output.copy_(out)

    def _stager(self, device: torch.device) -> CudaStaging:
        if device not in self._staging:
            self._staging[device] = CudaStaging(device, self.config.chunk_bytes)
        return self._staging[device]


_FIRST_FAILURE = "slipstream-first-failure"


def _with_first_failure(error: Exception) -> Exception:
    """``error``, naming the job's first failure when another rank's came first. A failure
    cascades (rank 3 dies; its node peer rank 2 raises and exits; rank 0 then loses its
    connection to rank 2), so each rank records its error in the default store, first writer
    wins, and a later one names the first: rank 0's error then says rank 3 died."""
    try:
        store = dist.distributed_c10d._get_default_store()
        mine = f"global rank {dist.get_rank()}: {error}"
        first = store.compare_set(_FIRST_FAILURE, "", mine).decode()
    except Exception:  # noqa: BLE001 - no store, or its host is gone: the error as it is
        return error
    if first == mine or not first:
        return error
    try:
        return type(error)(f"{error} (the first failure in the job, on {first})")
    except Exception:  # noqa: BLE001 - an error type that takes other arguments
        return RuntimeError(f"{error} (the first failure in the job, on {first})")


def as_torch_future(work, value) -> torch.futures.Future:
    """A ``torch.futures.Future`` that completes with ``value`` (or the call's error) when
    ``work`` does: an async call's handle, the core's ``Work`` or the stock collective's."""
    if isinstance(work, dist.Work):
        return work.get_future().then(lambda _: value)
    result: torch.futures.Future = torch.futures.Future()

    def done(cf) -> None:
        error = cf.exception()
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(value)

    work.get_future().add_done_callback(done)
    # torch's set_exception completes the future *successfully* with the exception object as
    # its value (only Python's value() re-raises it; C++ readers such as DDP's reducer take it
    # for a tensor). Re-raising inside a callback marks the chained future failed for all.
    return result.then(_value_or_raise)


def _value_or_raise(fut: torch.futures.Future):
    return fut.value()


def _invoke(impl, kind: str, output, input, op) -> None:
    if kind == "reduce_scatter":
        impl.reduce_scatter(output, input, op)
    else:
        impl.all_gather(output, input)

