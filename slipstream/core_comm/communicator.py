"""The communicator every adapter calls: one per process group.

It routes each call by the core's one rule (``routing``) and runs it: synchronously, or on its
worker thread with a ``Work`` handle (``async_op``). Ops: SUM, AVG (floating dtypes),
PREMUL_SUM (scale, then SUM), PRODUCT, MAX and MIN with gloo's semantics. The coalesced forms
run as one operation over one flat buffer. Every call is counted under its path (``counters``).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from concurrent.futures import Future, ThreadPoolExecutor, wait as futures_wait

import torch
import torch.distributed as dist

from . import counters
from .compat import all_gather_into_tensor, reduce_scatter_tensor
from .call_check import CallCheck, with_first_failure
from .collectives.cma import CmaComm
from .collectives.hierarchical import Hierarchical
from .collectives.shm import ShmComm, ShmError, check_sizes, is_supported_platform
from .collectives.staging import CudaStaging
from .config import CommConfig
from .groups import group_ranks, node_subgroups, release_groups
from .ops import describe, split_op
from . import routing
from .routing import Choice, Plan, route, use_cma, wire_format
from .topology import Topology, detect_topology
from .transport.gloo import GlooInter
from .transport.wire import WireInter
from .work import Work

__all__ = ["Communicator"]

log = logging.getLogger("slipstream.comm")
ReduceOp = dist.ReduceOp
RESIZE_CHUNK_MOST = 16 << 20
"""The most a reduce-scatter's or allgather's chunk takes. 256 MiB on 2x2 emulated nodes at 1
Gbit/s: 64-66% of the link's rate against 51-56% in 4 MiB chunks; 32 MiB chunks were no faster
and take twice the arenas (3 chunks in flight; benchmarks/results/chunks_*.md)."""


class Communicator:
    """Fast collectives over ``group`` (None: the default group). Construction is collective."""

    __slots__ = ("group", "config", "plan", "rank", "world", "topology", "checker",
                 "shm", "cma", "hier", "wire", "unavailable",  # built algorithms, and why the others are not
                 "_subgroups", "_one_per_node", "_backends", "_staging", "_executor", "_last")

    def __init__(self, group: dist.ProcessGroup | None = None, *, config: CommConfig | None = None,
                 topology: Topology | None = None, plan: Plan | None = None, checker: CallCheck | None = None) -> None:
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
        self.wire = None
        """The lossy cross-node exchange (``WireInter``) where ``config.wire`` asks for one."""
        self._subgroups: tuple = ()
        """The gloo groups ``_build`` made (inside the node, across the nodes), destroyed on close."""
        self.unavailable = self._build()
        self._one_per_node = self.hier is not None and self.topology.local_size == 1  # read on every call
        self._backends: dict = {}
        """device type -> the backend that serves it on the group (``routing.backend_of``)."""
        self._staging: dict = {}
        self._executor: ThreadPoolExecutor | None = None
        self._last: Future | None = None

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
        own = (self.group, dist.GroupMember.WORLD)  # the group itself, where it is its own intra-node group
        self._subgroups = tuple(g for g in (intra, inter) if g is not None and not any(g is o for o in own))
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
            if cfg.wire != "full":
                self.wire = WireInter(GlooInter(inter), cfg.wire)
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
        release_groups(*self._subgroups)
        self._subgroups = ()

    def held_bytes(self) -> int:
        """The bytes this rank's fast paths keep from call to call: the node's shared segment,
        the chunks' arenas, the cross-memory-attach buffers, a lossy wire's residuals (0 where
        the group is stock)."""
        return sum(p.held_bytes() for p in (self.shm, self.cma, self.hier, self.wire) if p is not None)

    def algorithm(self, tensor: torch.Tensor, op=ReduceOp.SUM, kind: str = "all_reduce") -> tuple[str, str]:
        """``(algorithm, reason)`` this communicator uses for ``kind`` on ``tensor`` and ``op``."""
        return self._route(kind, tensor, op)[:2]

    def _route(self, kind: str, tensor: torch.Tensor, op) -> tuple[str, str, Choice | None]:
        """``(algorithm, reason, the plan's choice)`` by the core's rule (``routing.route``)."""
        device = tensor.device.type
        if device not in self._backends:
            self._backends[device] = routing.backend_of(self.group, device)
        return route(kind, tensor, op, world=self.world, config=self.config, backend=self._backends[device],
                     plan=self.plan,
                     hierarchical=self.hier is not None, intra=self.shm is not None, unavailable=self.unavailable,
                     one_per_node=self._one_per_node)

    def _choose(self, kind: str, tensor: torch.Tensor, op, others=(), nbytes: int | None = None):
        """``(algorithm, plan choice, path label, the lossy exchange or None)`` for this call,
        counted under the label (``hierarchical-int8`` where it crosses nodes in int8)."""
        for other in others:
            if other.device != tensor.device:
                raise ValueError(f"{kind}: tensors on different devices: {tensor.device} and {other.device}")
        if self.config.debug:
            if self.checker is None:
                self.checker = CallCheck.for_group(self.group, self.config.timeout_s)
            self.checker.check(describe(kind, tensor, op))
        algo, why, choice = self._route(kind, tensor, op)
        if algo == "stock":
            log.debug("slipstream %s of %s %s (%s): stock collective: %s",
                      kind, tuple(tensor.shape), tensor.dtype, op, why)
        nbytes = tensor.numel() * tensor.element_size() if nbytes is None else nbytes
        if algo in ("hierarchical", "staged") and self.wire is not None:
            wire = wire_format(kind, tensor, op, config=self.config, nbytes=nbytes)
            if wire != "full":
                return algo, choice, f"{algo}-{wire}", self.wire
        return algo, choice, "cma" if algo == "shm" and self._intra(kind, nbytes) is self.cma else algo, None

    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False):
        """In place, like ``dist.all_reduce``; returns a ``Work`` when ``async_op``."""
        return self._all_reduce_as("all_reduce", tensor, op, async_op)

    def _all_reduce_as(self, counted: str, tensor: torch.Tensor, op, async_op: bool):
        algo, choice, label, lossy = self._choose("all_reduce", tensor, op)
        nbytes = tensor.numel() * tensor.element_size()
        with counters.record(counted, label, nbytes):
            if algo == "stock":
                self._count_stock_link("all_reduce", nbytes)
                dense, issued = _dense(tensor), time.perf_counter()
                work = dist.all_reduce(dense, op=op, group=self.group, async_op=async_op)
                return _stock(work, dense, tensor, issued)
            chunk = choice.chunk_bytes if choice is not None else None
            return self._run(lambda: self._all_reduce(algo, tensor, op, chunk, lossy), async_op, tensor.device)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                       async_op: bool = False, valid: list[int] | None = None):
        """Like ``dist.reduce_scatter_tensor``: ``input`` holds ``world`` blocks of ``output``'s size.
        ``valid[r]``: the leading elements of block ``r`` that matter, the rest being padding
        (zeros in every input; undefined in the output): across nodes only those cross the link
        (a reduce-scatter of unequal blocks). The same on every rank."""
        if valid is not None and (len(valid) != self.world or not all(0 <= v <= output.numel() for v in valid)):
            raise ValueError(f"reduce_scatter: valid needs {self.world} counts within 0..{output.numel()}, "
                             f"got {valid}")
        return self._resize_as("reduce_scatter", "reduce_scatter", output, input, op, async_op, valid)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, then=None):
        """Like ``dist.all_gather_into_tensor``; ``input`` may be a view into ``output``. ``then()``
        runs once the gather is done: on the core's paths by the thread that ran it, before this
        communicator's next call (so the buffer it empties may take the next call's output)."""
        return self._resize_as("all_gather", "all_gather", output, input, None, async_op, then=then)

    def node_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``all_gather`` among this node's ranks only (``output``: ``local_size`` blocks), through
        shared memory, blocking; CPU tensors of a group with shared memory on its node."""
        if self.shm is None or input.device.type != "cpu":
            raise ValueError("node_all_gather needs CPU tensors and a group with shared memory on its node")
        with counters.record("all_gather", "shm", output.numel() * output.element_size()):
            self._run(lambda: self.shm.all_gather(output, input), False, input.device)

    def _resize_as(self, counted: str, kind: str, output, input, op, async_op: bool, valid=None, then=None):
        check_sizes(kind, output, input, self.world)
        big = output if kind == "all_gather" else input
        nbytes = big.numel() * big.element_size()
        algo, _, label, lossy = self._choose(kind, input, ReduceOp.SUM if op is None else op, (output,), nbytes)
        with counters.record(counted, label, nbytes):
            if algo == "stock":
                self._count_stock_link(kind, nbytes)
                dense, issued = _dense(output), time.perf_counter()
                if kind == "all_gather":
                    work = all_gather_into_tensor(dense, _dense(input), group=self.group, async_op=async_op)
                else:
                    work = reduce_scatter_tensor(dense, _dense(input), op=op, group=self.group, async_op=async_op)
                work = _stock(work, dense, output, issued)
                return work if then is None else self._then(work, then, output.device)
            return self._run(lambda: (self._resize(kind, algo, output, input, op, valid, lossy), then and then()),
                             async_op, input.device)

    def _count_stock_link(self, kind: str, nbytes: int) -> None:
        """With one rank per node, what a stock ``kind`` of a whole buffer of ``nbytes`` sends
        across this rank's node link at least, counted as the hierarchical path counts its own
        (an allreduce 2(n-1)/n of the buffer, the others (n-1)/n), so that the link bound of a
        job does not depend on which path the rule chose."""
        if self._one_per_node:
            n = self.world
            counters.add_link((2 if kind == "all_reduce" else 1) * (n - 1) * nbytes // n)

    # The coalesced forms: one operation over one flat buffer, so a bucket of many small
    # tensors costs one synchronisation instead of one per tensor.

    def all_reduce_coalesced(self, tensors: list, op=ReduceOp.SUM, async_op: bool = False):
        """``all_reduce`` of each tensor (same dtype and device), as one call."""
        _check_coalesced("all_reduce_coalesced", tensors)
        flat = torch.cat([t.reshape(-1) for t in tensors])
        work = self._all_reduce_as("all_reduce_coalesced", flat, op, async_op)
        return self._then(work, lambda: _unflatten(flat, tensors), flat.device)

    def reduce_scatter_coalesced(self, outputs: list, inputs: list, op=ReduceOp.SUM, async_op: bool = False):
        """``reduce_scatter`` of each pair, as one call: the inputs' rank-r blocks are laid
        side by side, so rank r receives its blocks of every input in one shard."""
        _check_coalesced("reduce_scatter_coalesced", inputs, outputs, self.world)
        flat_in = torch.cat([i.reshape(self.world, -1) for i in inputs], dim=1).reshape(-1)
        flat_out = flat_in.new_empty(flat_in.numel() // self.world)
        work = self._resize_as("reduce_scatter_coalesced", "reduce_scatter", flat_out, flat_in, op, async_op)
        return self._then(work, lambda: _unflatten(flat_out, outputs), flat_out.device)

    def all_gather_coalesced(self, outputs: list, inputs: list, async_op: bool = False):
        """``all_gather`` of each pair, as one call."""
        _check_coalesced("all_gather_coalesced", inputs, outputs, self.world)
        flat_in = torch.cat([i.reshape(-1) for i in inputs])
        flat_out = flat_in.new_empty(flat_in.numel() * self.world)

        def scatter_back() -> None:
            rows = flat_out.view(self.world, -1)
            at = 0
            for o, i in zip(outputs, inputs):
                o.view(self.world, -1).copy_(rows[:, at:at + i.numel()])
                at += i.numel()

        work = self._resize_as("all_gather_coalesced", "all_gather", flat_out, flat_in, None, async_op)
        return self._then(work, scatter_back, flat_out.device)

    @staticmethod
    def _then(work, finish, device: torch.device):
        """Run ``finish`` after ``work`` (None: the call was synchronous and is done); for
        device tensors on the waiter's thread and stream, where its copies are then ordered."""
        if work is None:
            finish()
            return None
        return Work.after(work, finish, on_wait=device.type != "cpu")

    def _run(self, fn, async_op: bool, device: torch.device):
        """Run ``fn`` now, or on the worker thread (``async_op``). A collective reduces values,
        as gloo's does: outside autograd, also for a tensor that requires grad (DDP under
        ``backward(create_graph=True)``), where an ``out=`` reduction would raise. A CUDA
        call on the worker runs on the stream current where it was issued, so that its copies
        follow the work that wrote its input, and its ``Work`` completes once that stream has
        run them: a waiter on any stream finds the result there."""

        def values_only() -> None:
            try:
                with torch.no_grad():
                    fn()
            except Exception as e:  # noqa: BLE001 - re-raised with the job's first failure
                raise with_first_failure(e, within_s=min(1.0, 0.1 * self.config.timeout_s)) from e

        issued = time.perf_counter()
        if not async_op:
            try:
                self._drain()  # keep the order of calls the same on every rank
                values_only()
            finally:
                done = time.perf_counter()
                counters.timeline.flight(issued, done)
                counters.timeline.blocked(issued, done)
            return None

        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

        def in_flight() -> None:
            try:
                if stream is None:
                    values_only()
                else:
                    with torch.cuda.stream(stream):
                        values_only()
                        done = torch.cuda.Event()
                        done.record(stream)
                    done.synchronize()  # this thread waits, so that "complete" means the data is there
            finally:
                counters.timeline.flight(issued, time.perf_counter())

        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="slipstream-comm",
                                                initializer=counters.mark_comm_thread)
        self._last = self._executor.submit(in_flight)
        return Work(self._last)

    def _drain(self) -> None:
        """Wait for the last async call (calls run in order on every rank). Its error belongs
        to its own ``Work``, not to the next call: a broken group (a dead or mismatched peer)
        refuses every later call by itself."""
        if self._last is not None:
            futures_wait([self._last])
            self._last = None

    def _intra(self, kind: str, nbytes: int):
        """The one-node path of ``kind`` for ``nbytes`` (of the larger buffer), alike on all ranks."""
        return self.cma if self.cma is not None and use_cma(kind, nbytes) else self.shm

    def _cpu_all_reduce(self, flat: torch.Tensor, op, chunk_bytes: int | None, lossy=None) -> None:
        nbytes = flat.numel() * flat.element_size()
        if self.hier is None:
            self._intra("all_reduce", nbytes).all_reduce(flat, op)
            return
        # 64 MiB on 2x2 emulated nodes at 1 Gbit/s: 16 MiB chunks 814-874 ms, 4 MiB 992-1025 ms
        self.hier.all_reduce(flat, op, chunk_bytes=chunk_bytes or self._quarter(nbytes), inter=lossy)

    def _quarter(self, nbytes: int, most: int | None = None) -> int:
        """A quarter of ``nbytes``, at most ``most``, never less than ``chunk_bytes``: each chunk
        syncs every rank, which under the default scheduler (4 ranks and the link's network work
        on 2 cores) waits for a rank to be scheduled. A power of two: few sizes for the arenas."""
        quarter = 1 << max(0, (nbytes // 4).bit_length() - 1)
        return max(self.config.chunk_bytes, quarter if most is None else min(quarter, most))

    def _all_reduce(self, algo, tensor, op, chunk_bytes, lossy=None) -> None:
        op, factor = split_op(op)
        if factor is not None:
            tensor.mul_(factor)
        if algo == "local":
            return
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        if algo == "staged":
            self._stager(tensor.device).all_reduce(
                work, lambda host: self._cpu_all_reduce(host, op, chunk_bytes, lossy))
        else:
            self._cpu_all_reduce(work.view(-1), op, chunk_bytes, lossy)
        if work is not tensor:
            tensor.copy_(work)

    def _resize(self, kind, algo, output, input, op, valid=None, lossy=None) -> None:
        """Reduce-scatter or allgather (``kind``): output and input differ by the world size;
        ``lossy``: the cross-node exchange in a lossy format, or None."""
        if op is not None:
            op, factor = split_op(op)
            if factor is not None:  # the caller's input stays as it was, as with NCCL
                input = input * factor
        big = max(input.numel(), output.numel()) * input.element_size()  # bytes of the larger buffer
        if algo == "local":
            output.copy_(input.view_as(output))
        elif algo == "staged":
            host_out = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
            cpu_algo = "hierarchical" if self.hier else "shm"
            self._resize(kind, cpu_algo, host_out, self._stager(input.device).to_host(input), op, valid, lossy)
            output.copy_(host_out)
        elif algo == "shm":
            intra = self._intra(kind, big)
            intra.reduce_scatter(output, input, op) if kind == "reduce_scatter" else intra.all_gather(output, input)
        else:
            out = output if output.is_contiguous() else torch.empty_like(output)
            chunk = self._quarter(big, RESIZE_CHUNK_MOST)
            if kind == "reduce_scatter":
                self.hier.reduce_scatter(out.view(-1), input.reshape(-1), op, chunk, valid=valid, inter=lossy)
            else:
                self.hier.all_gather(out.view(-1), input.reshape(-1), chunk, inter=lossy)
            if out is not output:
                output.copy_(out)

    def _stager(self, device: torch.device) -> CudaStaging:
        if device not in self._staging:
            self._staging[device] = CudaStaging(device, self.config.chunk_bytes)
        return self._staging[device]


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a contiguous copy: gloo reduces a strided tensor's storage as if contiguous (wrongly)."""
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _stock(work: dist.Work | None, dense: torch.Tensor, output: torch.Tensor, issued: float) -> Work | None:
    """A stock collective's handle as the core's ``Work`` (None for a synchronous call), its
    ``dense`` result copied into ``output`` when they differ; in flight from ``issued``. For
    device tensors the Work completes through the stock ``wait()`` on the waiting thread (a
    future of NCCL's completes when the kernel is queued, not when the data is there)."""
    def back() -> None:
        if dense is not output:
            output.copy_(dense)
        counters.timeline.flight(issued, time.perf_counter())

    if work is None:
        back()
        counters.timeline.blocked(issued, time.perf_counter())
        return None
    return Work.after(work, back, on_wait=output.device.type != "cpu")


def _check_coalesced(kind: str, tensors: list, outputs: list | None = None, world: int = 0) -> None:
    """Same dtype and device throughout; with ``outputs``, one per input, sized for ``world``."""
    if not tensors or (outputs is not None and len(outputs) != len(tensors)):
        raise ValueError(f"{kind}: needs one or more tensors (and as many outputs as inputs)")
    first = tensors[0]
    for t in (*tensors, *(outputs or ())):
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"{kind}: tensors of different dtypes or devices: {first.dtype} on "
                             f"{first.device} and {t.dtype} on {t.device}")
    for o, i in zip(outputs or (), tensors):
        check_sizes(kind.removesuffix("_coalesced"), o, i, world)


def _unflatten(flat: torch.Tensor, tensors: list) -> None:
    at = 0
    for t in tensors:
        t.copy_(flat[at:at + t.numel()].view_as(t))
        at += t.numel()
