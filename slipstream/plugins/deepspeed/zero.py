"""ZeRO-1/2 gradient buckets reduced to their owners instead of to every rank.

DeepSpeed's stage 1/2 optimizer all-reduces a bucket of gradient slices and then keeps, on each
rank, only the slices of its own partition (``allreduce_and_copy_with_multiple_ranks``): every
rank receives the whole bucket and discards three quarters of it (4 ranks). A reduce-scatter
gives each rank exactly its slices: across nodes half the bytes of the all-reduce, the step's
largest transfer.

The patch (on the optimizer instance only, idempotent; ``unpatch_all`` or the plugin's
``uninstall`` removes it) lays the bucket out owner by owner (in DeepSpeed's order, zero-padded
to the largest owner's size), reduce-scatters it through DeepSpeed's communication backend (the
core's stand-in, ``comm_backend.py``) and copies the owned slices back exactly where DeepSpeed would.
Anything else (several owners of one slice, communication in another dtype, sequence
parallelism, owners too unequal to pad cheaply on one node, a bucket the routing decision
leaves to the group, such as CUDA on NCCL) goes to DeepSpeed's own method, with DeepSpeed's
own bytes on the wire.
Across nodes the padding never crosses the link: the core's reduce-scatter sends each owner
only its real slices (``valid``), so every bucket, even one inside a single owner's
partition, moves the least possible bytes.

On 2 emulated nodes x 2 ranks over 1 Gbit/s, 64 MiB: reduce-scatter 328 ms against 592 ms
for the allreduce (``slipstream bench comm``, benchmarks/results/finetune_*.md).
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch

from ..._common.patch import change, is_patched as _is_patched, patch, uninstall_all
from .overlap import OWNER as _OWNER, PREFETCH_BUCKET, STAGE3_PRIVATE, Deferred, Deferred3, stage3_name

__all__ = ["patch_zero_optimizer", "patch_zero3_optimizer", "unpatch_all", "is_patched", "overlaps", "owner_layout"]

_METHOD = "allreduce_and_copy_with_multiple_ranks"
# Largest padded size, relative to the bucket, still worth a reduce-scatter: an allreduce
# moves twice the bucket's bytes, so up to 1.5x padding is still cheaper across nodes.
MAX_PADDING = 1.5
# What the deferral reads of DeepSpeed's optimizer (DeepSpeed >= 0.17's bucket layout).
_DEFERRED_NEEDS = ("ipg_buckets", "reduce_ipg_grads", "average_tensor", "independent_gradient_partition_epilogue",
                   "extra_large_param_to_reduce", "use_multi_rank_bucket_allreduce")
# What the ZeRO-3 deferral reads (DeepSpeed >= 0.17): the instance's, then the class's private methods.
_DEFERRED3_NEEDS = ("ipg_buckets", "partition_grads", "independent_gradient_partition_epilogue", "reduce_scatter",
                    "_get_param_partition_group", "all2all_process_group", "postscale_gradients", "dtype",
                    "gradient_accumulation_dtype", "enable_sanity_checks", "offload_optimizer", "offload_param")
_STAGE3_REDUCE = stage3_name("reduce_and_partition_ipg_grads")


def owner_layout(numels: list[int], owners: list, world: int,
                 max_padding: float | None = MAX_PADDING) -> tuple[list[int], int, list[int]] | None:
    """Where each slice goes in the owner-by-owner layout: (offset of each slice, shard size,
    end of each owner's slices), or None when a slice has several owners or the padded size
    would exceed ``max_padding`` times the slices' (None: no limit)."""
    single = []
    for owner in owners:
        if isinstance(owner, (frozenset, set, tuple, list)):
            if len(owner) != 1:
                return None
            (owner,) = owner
        if not 0 <= int(owner) < world:
            raise ValueError(f"gradient slice owner {owner} outside the group of {world} ranks")
        single.append(int(owner))
    sizes = [0] * world
    for n, owner in zip(numels, single):
        sizes[owner] += n
    shard, total = max(sizes), sum(sizes)
    if total == 0 or (max_padding is not None and shard * world > max_padding * total):
        return None
    filled = [r * shard for r in range(world)]
    offsets = []
    for n, owner in zip(numels, single):
        offsets.append(filled[owner])
        filled[owner] += n
    return offsets, shard, filled


def _reduce_to_owners(self, deferred, signature, *args, **kwargs):
    """Drop-in for ``DeepSpeedZeroOptimizer.allreduce_and_copy_with_multiple_ranks``, whose
    arguments ``signature`` names: DeepSpeed 0.17 on passes the communication dtype and an output
    bucket, 0.16 neither (its communication dtype is the optimizer's). While ``deferred`` (an
    ``overlap.Deferred`` or None) collects a bucket's reductions, the reduce-scatter is issued
    async and its copy-back handed to it."""
    import deepspeed.comm as dist
    from deepspeed.runtime.zero import stage_1_and_2

    a = signature.bind(self, *args, **kwargs)
    a.apply_defaults()
    small_bucket, divide, bucket_ranks = a.arguments["small_bucket"], a.arguments["divide"], a.arguments["bucket_ranks"]
    communication_data_type = a.arguments.get("communication_data_type", getattr(self, "communication_data_type", None))
    output_bucket = a.arguments.get("output_bucket")
    group = self.dp_process_group if a.arguments["process_group"] is None else a.arguments["process_group"]
    backend = dist.comm.cdb  # the core's stand-in (comm_backend.py), possibly behind a timer
    dtype = small_bucket[0].dtype if small_bucket else None
    # the core's path only where the routing decision gives it the bucket: on NCCL the padded
    # layout would cross the wire whole (up to 8x DeepSpeed's bytes on 2 x 8 GPUs)
    ours = (hasattr(backend, "takes") and dtype is not None
            and backend.takes(group, small_bucket[0].device.type, dtype))
    comm = backend.communicator(group) if ours else None
    world = dist.get_world_size(group=group)
    layout = None
    if (ours and bucket_ranks is not None and dtype == communication_data_type
            and not stage_1_and_2.pg_correctness_test
            and self.sequence_parallel_size == 1 and all(t.dtype == dtype for t in small_bucket)):
        # across nodes only the owners' real slices cross the link: any padding is free there
        layout = owner_layout([t.numel() for t in small_bucket], list(bucket_ranks), world,
                              max_padding=None if comm is not None and comm.hier is not None else MAX_PADDING)
    if layout is None:
        return type(self).allreduce_and_copy_with_multiple_ranks(self, *args, **kwargs)
    offsets, shard, ends = layout
    flat = torch.zeros(world * shard, dtype=dtype, device=small_bucket[0].device)  # zero padding
    for t, start in zip(small_bucket, offsets):
        flat[start:start + t.numel()].copy_(t.reshape(-1))
    if divide and self.gradient_average:
        flat.div_(world)
    mine = torch.empty(shard, dtype=dtype, device=flat.device)
    collecting = deferred.collecting if deferred is not None else None
    valid = [end - r * shard for r, end in enumerate(ends)]  # across nodes only each owner's real slices cross
    work = backend.reduce_scatter_tensor(mine, flat, group=group, async_op=collecting is not None, valid=valid)
    base = dist.get_rank(group=group) * shard
    outputs = output_bucket if output_bucket is not None else [None] * len(small_bucket)

    def copy_back() -> None:
        for buf, start, output in zip(small_bucket, offsets, outputs):
            if base <= start < base + shard:
                synced = mine[start - base:start - base + buf.numel()].view_as(buf)
                if output is not None:  # DeepSpeed 0.17 on: its compact gradient partition
                    self._add_to_grad_partition_buffer(output, synced)
                buf.copy_(synced)

    if collecting is not None:
        collecting.append((work, copy_back))
    else:
        copy_back()


def is_patched(optimizer) -> bool:
    return _is_patched(optimizer, _METHOD)


def patch_zero_optimizer(optimizer, overlap: bool = False, trial=None, overlap_bucket: int | None = None) -> bool:
    """Reduce ``optimizer``'s gradient buckets to their owners, with ``overlap`` while backward
    goes on (``overlap.py``), or, given ``trial`` (an ``OverlapTrial``), in the mode it says step
    by step, with ``overlap_bucket`` elements a bucket in overlapped steps (DeepSpeed's own
    size in blocking ones); True when patched (a stage 1/2 ZeRO optimizer), False for anything
    else. Idempotent."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:  # pragma: no cover - depends on the DeepSpeed version
        return False
    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or not hasattr(DeepSpeedZeroOptimizer, _METHOD):
        return False
    deferred = None
    if (overlap or trial is not None) and all(hasattr(optimizer, n) for n in _DEFERRED_NEEDS):
        deferred = Deferred(*_trial_buckets(optimizer, trial, overlap_bucket))
        if trial is not None:
            deferred.size_for_mode(optimizer)  # the first step's: a cached choice holds from it
    signature = inspect.signature(getattr(DeepSpeedZeroOptimizer, _METHOD))
    patch(optimizer, _METHOD, functools.partial(_reduce_to_owners, optimizer, deferred, signature), owner=_OWNER)
    if deferred is not None:
        patch(optimizer, "reduce_ipg_grads", functools.partial(deferred.reduce_ipg_grads, optimizer), owner=_OWNER)
        patch(optimizer, "independent_gradient_partition_epilogue", functools.partial(deferred.epilogue, optimizer),
              owner=_OWNER)
    return True


def patch_zero3_optimizer(optimizer, trial=None, overlap_bucket: int | None = None,
                          overlap_prefetch: int | None = None) -> bool:
    """Reduce-scatter ``optimizer``'s gradient buckets while backward goes on (``overlap.py``),
    or, given ``trial`` (an ``OverlapTrial``), in the mode it says step by step, with
    ``overlap_bucket`` elements a bucket and ``overlap_prefetch`` elements a parameter prefetch
    in overlapped steps (DeepSpeed's own sizes in blocking ones, as with ``"overlap": false``);
    True when patched (DeepSpeed's own ZeRO-3 optimizer, not a subclass), False otherwise.
    Idempotent."""
    try:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    except ImportError:  # pragma: no cover - depends on the DeepSpeed version
        return False
    if (type(optimizer) is not DeepSpeedZeroOptimizer_Stage3
            or not all(hasattr(DeepSpeedZeroOptimizer_Stage3, n) for n in map(stage3_name, STAGE3_PRIVATE))
            or not all(hasattr(optimizer, n) for n in _DEFERRED3_NEEDS)):
        return False
    deferred = Deferred3(*_trial_buckets(optimizer, trial, overlap_bucket),
                         prefetch=_trial_prefetch(optimizer, trial, overlap_prefetch))
    deferred.set_prefetch(optimizer)  # the first step's, in the trial's first mode
    if trial is not None and deferred.size_for_mode(optimizer):  # a cached choice holds from the first step
        deferred.resize_buffers(optimizer)
    patch(optimizer, _STAGE3_REDUCE, functools.partial(deferred.reduce_and_partition, optimizer), owner=_OWNER)
    patch(optimizer, "independent_gradient_partition_epilogue", functools.partial(deferred.epilogue, optimizer),
          owner=_OWNER)
    return True


def _trial_buckets(optimizer, trial, overlap_bucket: int | None) -> tuple:
    """A deferral's ``(trial, (blocking, overlapped) bucket sizes)``: DeepSpeed's allocated size
    in blocking steps, ``overlap_bucket`` (at most that) in overlapped ones; ``(None, None)``
    without a trial. The size the trial changes step by step is put back with the patches."""
    if trial is None:
        return None, None
    size = int(optimizer.reduce_bucket_size)  # what DeepSpeed allocated its bucket buffers for
    ref = weakref.ref(optimizer)
    change(("zero-buckets", id(optimizer)), f"{type(optimizer).__name__}.reduce_bucket_size, set per step "
           "by the overlap trial", lambda: ref() is not None and setattr(ref(), "reduce_bucket_size", size),
           owner=_OWNER, target=optimizer)
    return trial, (size, min(size, overlap_bucket or size))


def _trial_prefetch(optimizer, trial, overlap_prefetch: int | None) -> tuple[int, int] | None:
    """ZeRO-3's parameter prefetch bucket for (blocking, overlapped) steps of ``trial``:
    DeepSpeed's own in blocking ones, ``overlap_prefetch`` in overlapped ones; None without a
    trial, a size, or DeepSpeed's coordinator attribute. The size is put back with the patches."""
    coordinator = getattr(optimizer, "_get_param_coordinator", lambda: None)()
    if trial is None or overlap_prefetch is None or not hasattr(coordinator, PREFETCH_BUCKET):
        return None
    own = getattr(coordinator, PREFETCH_BUCKET)
    ref = weakref.ref(coordinator)
    change(("zero-prefetch", id(coordinator)), f"{type(coordinator).__name__}'s prefetch bucket, set per step "
           "by the overlap trial", lambda: ref() is not None and setattr(ref(), PREFETCH_BUCKET, own),
           owner=_OWNER, target=coordinator)
    return own, int(overlap_prefetch)


def overlaps(optimizer) -> bool:
    """Whether ``optimizer``'s buckets are reduced while backward goes on."""
    return _is_patched(optimizer, "independent_gradient_partition_epilogue")


def unpatch_all() -> None:
    """Unpatch every optimizer patched in this process."""
    uninstall_all(_OWNER)
