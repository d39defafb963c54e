"""Megatron DDP's gradient buckets all-reduced while backward goes on, on a CPU, where a trial
measures it faster (``"overlap": "auto"``, the default) or where it is forced (``true``).

Megatron's ``DistributedDataParallel`` reduces its gradients in ``finish_grad_sync``, after
backward, in one blocking call per bucket group, unless the job built it with
``overlap_grad_reduce``: then each bucket's all-reduce is issued asynchronously from the
gradient hooks as soon as the bucket is full, and ``finish_grad_sync`` waits for them. Megatron
reads the flag at each step: ``start_grad_sync`` issues async calls only under it, and
``finish_grad_sync`` without it issues the blocking ones itself. What the flag needs at
construction is buckets: without it Megatron makes one bucket of the whole model.

So a DDP built with ``overlap_grad_reduce`` off, on a CPU, whose data-parallel group the core
serves (``prepare``):

- is built from a copy of its ``DistributedDataParallelConfig`` (the job's own object is not
  changed) with the flag on and, where the job set none, the tuner's all-reduce bucket size;
- is then switched step by step (``engage``): under ``true`` every step is overlapped; under
  ``"auto"`` an ``OverlapTrial`` runs blocking steps and overlapped ones in turns, timed at
  the end of each ``finish_grad_sync``, and keeps the faster. A blocking step all-reduces each
  gradient buffer whole in one call, as Megatron does for a DDP built without overlap (the
  bucket groups' own blocking path would issue one call a bucket).

Either way every gradient element is the sum of the same values: bit-equal with two ranks
(a + b either way); with more, a collective whose order of summation follows the call's size
may round differently. The distributed optimizer (reduce-scatters and a parameter all-gather
that follow the flag too) is left as the job built it; so is a DDP with bucketing disabled,
one already overlapped, one on a GPU and one whose group stays stock.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import weakref

import torch
import torch.distributed as dist

from ..._common.patch import change, patch
from ..._common.record import update_stack
from ...core_comm import pool

__all__ = ["Plan", "engage", "prepare"]

OWNER = "megatron-overlap"


@dataclasses.dataclass
class Plan:
    """What ``prepare`` decided for one DDP being built."""

    mode: bool | str
    """``True`` (forced) or ``"auto"``."""
    ddp_config: object
    """The copy the DDP is built from: ``overlap_grad_reduce`` on, buckets sized."""
    bucket: int
    """Elements a bucket."""
    group: object
    """The group the trial agrees over (None: every rank)."""


def prepare(config, ddp_config, module: torch.nn.Module, disable_bucketing: bool, pg_collection) -> Plan | None:
    """The plan for a DDP about to be built from ``config`` (its ``TransformerConfig``) and
    ``ddp_config``, or None where it is built as the job asked (see the module's docstring)."""
    mode = pool.POOL.default_config().overlap
    if not dist.is_initialized() or any(p.device.type != "cpu" for p in module.parameters()):
        return None
    group = _data_parallel_group(pg_collection)
    if group is None or dist.get_world_size(group) == 1 or pool.POOL.decide(group, "cpu", torch.float32):
        return None  # no data-parallel exchange through the core
    why = ("forced off" if mode is False
           else "the job's own overlap_grad_reduce" if ddp_config.overlap_grad_reduce
           else "blocking: the distributed optimizer is left as the job built it"
           if ddp_config.use_distributed_optimizer
           else "blocking: the job disabled bucketing" if disable_bucketing else None)
    if why is not None:
        update_stack("megatron", buckets_during_backward=bool(ddp_config.overlap_grad_reduce), overlap=why)
        return None
    bucket = ddp_config.bucket_size
    if bucket is None:
        from ...core_comm.tuner import load_plan

        comm = pool.POOL.get(group)  # built now by every member, as its first collective would
        plan = comm.plan or load_plan(comm)
        size = 4 if ddp_config.grad_reduce_in_fp32 else _element_size(module)
        bucket = max(1, plan.buckets.all_reduce_bytes // size)
    copy = dataclasses.replace(ddp_config, overlap_grad_reduce=True, bucket_size=bucket)
    # the trial agrees over every rank where each runs the same steps (TP peers wait on each
    # other: one choice for all); with pipeline stages, over the data-parallel group
    pipeline = getattr(config, "pipeline_model_parallel_size", 1) or 1
    return Plan(mode, copy, bucket, None if pipeline == 1 else group)


def engage(ddp, plan: Plan) -> None:
    """Run ``ddp`` (built from ``plan.ddp_config``) overlapped, or under ``"auto"`` in the
    mode of its trial step by step; through the registry (``disable()`` puts the job's flag
    back and the method as it was)."""
    trial = _trial(ddp, plan) if plan.mode == "auto" else None
    own = ddp.ddp_config
    own.overlap_grad_reduce = trial is None or trial.overlap  # a trial's first step blocks; a cached choice holds
    if trial is not None:
        from .._adapter import note_overlap_choice

        original = type(ddp).finish_grad_sync

        @functools.wraps(original)
        def finish_grad_sync(*args, **kwargs):
            result = original(ddp, *args, **kwargs) if own.overlap_grad_reduce else _blocking_sync(ddp)
            trial.step_done()  # the same point of every step on every rank
            own.overlap_grad_reduce = trial.overlap
            return result

        patch(ddp, "finish_grad_sync", finish_grad_sync, owner=OWNER)
        trial.on_decided = note_overlap_choice("megatron", "buckets_during_backward")
    ref = weakref.ref(own)
    change(("megatron-overlap", id(ddp)), f"{type(ddp).__name__}'s overlap_grad_reduce, set by slipstream's overlap",
           lambda: ref() is not None and setattr(ref(), "overlap_grad_reduce", False), owner=OWNER, target=ddp)
    update_stack("megatron", buckets_during_backward=trial.pending if trial is not None else True,
                 overlap=trial.reason if trial is not None else "forced on",
                 gradient_bucket=f"{plan.bucket} elements")


def _blocking_sync(ddp) -> None:
    """A blocking step's gradient sync as Megatron runs it for a DDP built without overlap:
    each buffer's gradients scaled and all-reduced in one call. (The bucket groups' own
    blocking path would issue one call a bucket: the same bytes in more, smaller calls, which
    the routing may send to the stock collective one by one.)"""
    own = ddp.ddp_config
    nan, large = own.check_for_nan_in_grad, getattr(own, "check_for_large_grads", False)
    for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        if group.grad_reduce_handle is not None:
            raise RuntimeError("slipstream: a blocking step found a gradient all-reduce still in flight")
        group.param_gather_dispatched = False
        if nan or large:
            group.check_grads(check_for_nan_or_inf=nan, check_for_large=large)
    op = dist.ReduceOp.AVG if own.average_in_collective else dist.ReduceOp.SUM
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        if buffer.gradient_scaling_factor != 1.0:
            buffer.grad_data *= buffer.gradient_scaling_factor
        dist.all_reduce(buffer.grad_data, op=op, group=buffer.data_parallel_group)


def _trial(ddp, plan: Plan):
    from ...core_comm.tuner.overlap import OverlapTrial

    params = [p for p in ddp.module.parameters() if p.requires_grad]
    key = {"stack": "megatron-ddp", "model": type(ddp.module).__name__, "params": sum(p.numel() for p in params),
           "tensors": len(params), "dtype": str(params[0].dtype) if params else "", "bucket": plan.bucket,
           "world": dist.get_world_size(), "ranks_per_node": os.environ.get("LOCAL_WORLD_SIZE", "")}
    return OverlapTrial("Megatron DDP gradient buckets", key, plan.group)


def _data_parallel_group(pg_collection):
    """The group Megatron's DDP reduces over: the collection's ``dp_cp`` (or ``dp``), else
    parallel_state's data-parallel group with context parallelism."""
    for name in ("dp_cp", "dp"):
        group = getattr(pg_collection, name, None) if pg_collection is not None else None
        if group is not None:
            return group
    from megatron.core import parallel_state

    try:
        return parallel_state.get_data_parallel_group(with_context_parallel=True)
    except (AssertionError, AttributeError):  # parallel_state not initialised
        return None


def _element_size(module: torch.nn.Module) -> int:
    for p in module.parameters():
        return p.element_size()
    return 4
