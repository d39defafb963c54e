"""The ``slipstream`` torch.distributed backend: ``dist.init_process_group("slipstream")``.

A ``SlipstreamProcessGroup`` is a Python ``torch.distributed.ProcessGroup`` (the form of
torch's threaded test backend) holding its ranks' stock backends, built from the group's
store: ``ProcessGroupGloo`` for CPU tensors and, where CUDA and NCCL exist,
``ProcessGroupNCCL`` for CUDA tensors. Through the core's ``Communicator`` go ``allreduce``
(one tensor), ``all_gather_single`` (``all_gather_into_tensor``), ``reduce_scatter_single``
(``reduce_scatter_tensor``) and their coalesced forms (torch's coalescing manager, for FSDP and
Megatron), each as one operation. Everything else, and an accelerated call that
``routing.refusal`` refuses or that has a per-call timeout, a size the plan routes to stock or
CUDA tensors where NCCL exists, goes to the stock backend of the tensors' device, exactly as
with ``"cpu:gloo,cuda:nccl"``. Each call is counted under its path (``core_comm.counters``).

The communicator comes from the pool (``pool.get(group)``), built on the first call that can
use it (a collective), over a gloo group of the same ranks (``core_spec``): its own
collectives never come back here. ``new_group(backend=None)`` on a slipstream default group
makes slipstream groups, each with its own gloo group, built by its members only. Async calls
run on the communicator's worker thread and return a ``Work`` whose future's value is the
list of output tensors, as gloo's is.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    ReduceScatterOptions,
)

from .. import counters, pool
from ..call_check import CallCheck, checked
from ..communicator import Communicator
from ..config import CommConfig
from ..groups import new_gloo_group
from ..ops import describe
from ..routing import refusal
from ..work import Work
from . import BACKEND

__all__ = ["BACKEND", "SlipstreamProcessGroup", "create_process_group"]


log = logging.getLogger("slipstream.backend")

ReduceOp = dist.ReduceOp
BackendType = dist.ProcessGroup.BackendType
_UNSET_TIMEOUT = AllreduceOptions().timeout  # -1 ms: "the group's timeout"


def _delegated(name: str, agreed: str | None = None):
    """A method that calls the stock backend's ``name`` for the call's device (after the
    same-call check of ``agreed``, where given); why: the comment above ``allgather`` below."""

    def method(self, *args, **kwargs):
        tensor = _first_tensor(args, kwargs)
        if agreed is not None:
            self._agree(agreed, tensor)
        return getattr(self._stock(tensor), name)(*args, **kwargs)

    return method


class SlipstreamProcessGroup(dist.ProcessGroup):
    """One process group of the ``slipstream`` backend. Made by ``init_process_group`` /
    ``new_group``, not by hand (``create_process_group`` is the creator torch calls)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, *,
                 global_ranks: list[int], group_name: str, config: CommConfig) -> None:
        super().__init__(rank, size)
        # what the group is
        self._rank = rank
        self._size = size
        self._global_ranks = tuple(global_ranks) if global_ranks else tuple(range(size))
        self._config = config
        self.timeout = timeout
        """The group's timeout (``init_process_group(timeout=)``): its communicator's waits
        are bounded by the shorter of it and ``config.timeout_s``."""
        # the stock backends: every call the core does not take
        self._gloo = _gloo(store, rank, size, timeout, self._global_ranks, group_name)
        self._register_backend(torch.device("cpu"), BackendType.GLOO, self._gloo)
        self._nccl = _nccl(store, rank, size, timeout, self._global_ranks, group_name)
        if self._nccl is not None:
            self._register_backend(torch.device("cuda"), BackendType.NCCL, self._nccl)
        self._set_default_backend(BackendType.GLOO)
        self.call_check = CallCheck(dist.PrefixStore("slipstream-check/", store), rank, size,
                                    min(timeout.total_seconds(), config.timeout_s))
        """``SLIPSTREAM_DEBUG``'s same-call check, made before every collective of the group."""

    def getBackendName(self) -> str:  # noqa: N802 - torch's name (``pg.name()``)
        return BACKEND

    def __repr__(self) -> str:
        return f"SlipstreamProcessGroup(rank={self._rank}, size={self._size}, ranks={list(self._global_ranks)})"

    def device_backend(self, device_type: str) -> str:
        """What serves ``device_type`` tensors here (``routing.backend_of``): NCCL for CUDA
        tensors where the group built one, else this backend (gloo underneath)."""
        return "nccl" if device_type == "cuda" and self._nccl is not None else BACKEND

    @property
    def communicator(self) -> Communicator | None:
        """The core's communicator of this group; None until the first accelerated call."""
        return pool.peek(self)

    def core_spec(self, config: CommConfig) -> tuple:
        """What the pool builds this group's communicator with: a gloo group of the same ranks
        (the core's own collectives must not come back here), ``config`` with every wait
        within the group's own timeout where that is shorter, and the group's same-call check
        (one sequence of checks per group, the backend's and the communicator's). Collective."""
        config = replace(config, timeout_s=min(config.timeout_s, self.timeout.total_seconds()))
        over = new_gloo_group(list(self._global_ranks), timedelta(seconds=config.timeout_s))
        return over, config, self.call_check

    def allreduce(self, tensors, opts=AllreduceOptions()):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        opts = _as_opts(opts, AllreduceOptions)
        op = opts.reduceOp
        self._agree("all_reduce", tensors, op)
        if len(tensors) != 1:  # gloo's several-tensors form reduces across them too: stock
            return self._stock(tensors[0]).allreduce(tensors, opts)
        tensor = tensors[0]
        comm = self._fast(tensor, op, opts, "all_reduce", nbytes=_nbytes(tensor))
        if comm is None:
            return self._stock(tensor).allreduce(tensors, opts)
        return _launch(lambda a: comm.all_reduce(tensor, op, async_op=a), tensors, opts)

    def allreduce_coalesced(self, tensors, opts=AllreduceCoalescedOptions()):
        """Every tensor all-reduced, as one operation over a flat buffer."""
        opts = _as_opts(opts, AllreduceCoalescedOptions)
        op = opts.reduceOp
        self._agree("all_reduce_coalesced", tensors, op)
        comm = (tensors and all(t.dtype == tensors[0].dtype for t in tensors)
                and self._fast(tensors[0], op, opts, "all_reduce_coalesced", *tensors[1:], nbytes=_nbytes(*tensors)))
        if not comm:
            return self._stock(_first_tensor([tensors])).allreduce_coalesced(tensors, opts)
        return _launch(lambda a: comm.all_reduce_coalesced(tensors, op, async_op=a), tensors, opts)

    def all_gather_single(self, output, input, opts=AllgatherOptions()):
        """``output`` holds ``size()`` blocks of ``input``'s shape, in group-rank order."""
        opts = _as_opts(opts, AllgatherOptions)
        self._agree("all_gather", output)
        comm = (_fits(output, input, self._size, gather=True)
                and self._fast(input, ReduceOp.SUM, opts, "all_gather", output, nbytes=_nbytes(output)))
        if not comm:
            return self._stock(input)._allgather_base(output, input, opts)
        return _launch(lambda a: comm.all_gather(output, input, async_op=a), [output], opts)

    def reduce_scatter_single(self, output, input, opts=ReduceScatterOptions()):
        """``input`` holds ``size()`` blocks of ``output``'s shape; block r reduces into rank r."""
        opts = _as_opts(opts, ReduceScatterOptions)
        op = opts.reduceOp
        self._agree("reduce_scatter", input, op)
        comm = (_fits(output, input, self._size, gather=False)
                and self._fast(input, op, opts, "reduce_scatter", output, nbytes=_nbytes(input)))
        if not comm:
            return self._stock(input)._reduce_scatter_base(output, input, opts)
        return _launch(lambda a: comm.reduce_scatter(output, input, op, async_op=a), [output], opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=AllgatherOptions()):
        """Coalesced ``all_gather_into_tensor``: one operation over the pairs."""
        opts = _as_opts(opts, AllgatherOptions)
        self._agree("all_gather_coalesced", outputs)
        comm = self._fast_pairs(outputs, inputs, ReduceOp.SUM, opts, "all_gather_coalesced", gather=True)
        if comm is None:
            return self._stock_coalesced(self.all_gather_single, outputs, inputs, opts)
        return _launch(lambda a: comm.all_gather_coalesced(outputs, inputs, async_op=a), outputs, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=ReduceScatterOptions()):
        """Coalesced ``reduce_scatter_tensor``: one operation over the pairs."""
        opts = _as_opts(opts, ReduceScatterOptions)
        op = opts.reduceOp
        self._agree("reduce_scatter_coalesced", inputs, op)
        comm = self._fast_pairs(outputs, inputs, op, opts, "reduce_scatter_coalesced", gather=False)
        if comm is None:
            return self._stock_coalesced(self.reduce_scatter_single, outputs, inputs, opts)
        return _launch(lambda a: comm.reduce_scatter_coalesced(outputs, inputs, op, async_op=a), outputs, opts)

    # torch < 2.13 calls these names.
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # Delegated collectives: torch's C++ trampoline for a Python ProcessGroup (``WORK_OVERRIDE`` in
    # PyProcessGroup.hpp, torch 2.13) looks for a Python override with the GIL held and, when
    # there is none, calls the C++ ProcessGroup method *still holding the GIL*. Gloo's enqueue
    # then takes its work mutex, while a gloo worker thread that holds that mutex may be
    # destroying a finished work whose tensors have Python objects, which needs the GIL: a
    # deadlock (py-spy, 2026-11-21: main thread in ProcessGroupGloo::enqueue, worker in
    # ~AsyncAllgatherWork -> decref_pyobject waiting for the GIL; about 1 run in 4 of
    # tests/test_backend.py). Every method the trampoline covers is therefore defined here,
    # and calls the stock backend through its Python binding, which releases the GIL.

    allgather = _delegated("allgather", "list all_gather")
    all_to_all_single = alltoall_base = _delegated("alltoall_base", "all_to_all")
    broadcast = _delegated("broadcast", "broadcast")
    reduce_scatter = _delegated("reduce_scatter", "list reduce_scatter")
    send = _delegated("send")
    recv = _delegated("recv")

    def barrier(self, *args, **kwargs):
        self._agree("barrier", None)
        return self._gloo.barrier(*args, **kwargs)  # torch's own barrier runs on the default backend

    def shutdown(self) -> None:
        """Called by ``destroy_process_group``: finish this group's pending fast calls and
        release its shared memory (other groups' communicators stay), then shut the stock
        backends down."""
        pool.close(self)
        super().shutdown()

    def _agree(self, kind: str, tensors, op=None) -> None:
        """With ``SLIPSTREAM_DEBUG``, every rank checks that the others make this call too."""
        if self._config.debug and self._size > 1:
            tensor = tensors[0] if isinstance(tensors, (list, tuple)) and tensors else tensors
            self.call_check.check(describe(kind, tensor if isinstance(tensor, torch.Tensor) else None, op))

    @staticmethod
    def _stock_coalesced(single, outputs, inputs, opts):
        """A coalesced call the core does not take: one ``single`` call per pair (the stock
        backends' Python bindings have no coalesced form), in one ``Work`` that waits through
        each call's own ``wait()`` (a future of NCCL's completes at enqueue)."""
        with checked():
            return Work.of_stock([single(o, i, opts) for o, i in zip(outputs, inputs)], result=outputs)

    def _stock(self, tensor: torch.Tensor | None):
        """The stock backend for ``tensor``'s device (gloo when there is no NCCL or no tensor)."""
        if tensor is not None and tensor.device.type == "cuda" and self._nccl is not None:
            return self._nccl
        return self._gloo

    def _fast(self, tensor, op, opts, kind, *others, nbytes: int) -> Communicator | None:
        """The communicator when the part of the core's rule that needs none
        (``routing.refusal``) lets the call in, and what only the backend sees (a group of one
        rank; a per-call timeout, the stock backend's); else None (stock, counted). Decided
        from what every rank passes alike, so all ranks decide the same; the first yes builds
        the communicator (collective)."""
        if self._size == 1:
            why = "the group has one rank"
        elif opts.timeout != _UNSET_TIMEOUT:
            why = "a per-call timeout is the stock backend's"
        else:
            why = refusal(tensor, op, others, config=self._config, backend=self.device_backend(tensor.device.type))
        if why is None:
            return pool.get(self, config=self._config)
        log.debug("slipstream %s of %s %s: stock %s: %s", kind, tuple(tensor.shape), tensor.dtype,
                  self._stock(tensor).name(), why)
        counters.count(kind, "stock", nbytes)
        return None

    def _fast_pairs(self, outputs, inputs, op, opts, kind, *, gather: bool) -> Communicator | None:
        if not inputs or len(outputs) != len(inputs):
            return None
        if not all(_fits(o, i, self._size, gather=gather) and i.dtype == inputs[0].dtype
                   for o, i in zip(outputs, inputs)):
            return None
        big = outputs if gather else inputs
        return self._fast(inputs[0], op, opts, kind, *inputs[1:], *outputs, nbytes=_nbytes(*big))


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _as_opts(opts, kind):
    """``pg.allreduce(t, op)`` is a public overload too: turn a bare op into options."""
    if isinstance(opts, kind):
        return opts
    made = kind()
    made.reduceOp = opts
    return made


def _first_tensor(args, kwargs=None) -> torch.Tensor | None:
    """The first tensor in a call's arguments (lists searched), which picks the device."""
    for arg in (*args, *(kwargs or {}).values()):
        if isinstance(arg, torch.Tensor):
            return arg
        if isinstance(arg, (list, tuple)):
            found = _first_tensor(arg)
            if found is not None:
                return found
    return None


def _fits(output: torch.Tensor, input: torch.Tensor, size: int, *, gather: bool) -> bool:
    """The concatenated layout gloo accepts: the big tensor is ``size`` small ones along
    dim 0, same dtype. Anything else (the stacked form NCCL also takes) goes to gloo, which
    raises its own error, so a call fails or succeeds alike whichever path it takes."""
    big, small = (output, input) if gather else (input, output)
    if output.dtype != input.dtype or small.dim() == 0:
        return False
    return big.shape == (size * small.shape[0], *small.shape[1:])


def _launch(run, outputs: list, opts):
    """Run ``run(async_op)`` and wrap it as a torch ``Work`` whose future holds ``outputs``.
    An async call's error reaches torch as an error: ``wait()`` raises it and the future is
    failed (``_create_work_from_future``'s ``wait`` returns even then, torch 2.13)."""
    if not opts.asyncOp:
        with checked():
            run(False)  # an error raises here, in the caller
        return Work.completed(outputs)
    with checked():  # the backend checked the call already
        return run(True).returning(outputs)


def _gloo(store, rank, size, timeout, global_ranks, group_name) -> dist.ProcessGroupGloo:
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
    gloo.options.global_ranks_in_group = list(global_ranks)
    gloo.options.group_name = group_name
    gloo._set_sequence_number_for_group()
    return gloo


def _nccl(store, rank, size, timeout, global_ranks, group_name):
    if not (dist.is_nccl_available() and torch.cuda.is_available()):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    options.global_ranks_in_group = list(global_ranks)
    options.group_name = group_name
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, options)
    nccl._set_sequence_number_for_group()
    return nccl


def create_process_group(dist_options, pg_options=None):
    """torch's creator for the backend (``register_backend(..., extended_api=True)``). The
    group's settings: ``pg_options`` (a ``CommConfig`` passed to ``init_process_group`` /
    ``new_group``), else the pool's default (``pool.default_config``: ``enable(config)``'s, else
    the environment's)."""
    if pg_options is not None and not isinstance(pg_options, CommConfig):
        raise TypeError(f"the slipstream backend takes a CommConfig as pg_options, got {type(pg_options).__name__}")
    return SlipstreamProcessGroup(
        dist_options.store, dist_options.group_rank, dist_options.group_size, dist_options.timeout,
        global_ranks=list(dist_options.global_ranks_in_group), group_name=str(dist_options.group_id),
        config=pg_options or pool.default_config())
