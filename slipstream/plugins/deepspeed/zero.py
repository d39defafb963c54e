"""ZeRO-1/2 gradient buckets reduced to their owners instead of to every rank.

DeepSpeed's stage 1/2 optimizer all-reduces a bucket of gradient slices and then keeps, on each
rank, only the slices of its own partition (``allreduce_and_copy_with_multiple_ranks``): every
rank receives the whole bucket and discards three quarters of it (4 ranks). A reduce-scatter
gives each rank exactly its slices: across nodes half the bytes of the all-reduce, the step's
largest transfer.

The patch (on the optimizer instance only, idempotent; ``unpatch_all`` or the plugin's
``uninstall`` removes it) lays the bucket out owner by owner (in DeepSpeed's order, zero-padded
to the largest owner's size), reduce-scatters it through ``deepspeed.comm`` (so through the core
when its backend is installed) and copies the owned slices back exactly where DeepSpeed would.
Anything else (several owners of one slice, communication in another dtype, sequence
parallelism, owners too unequal to pad cheaply) goes to DeepSpeed's own method.

On 2 emulated nodes x 2 ranks over 1 Gbit/s, 64 MiB: reduce-scatter 328 ms against 592 ms
for the allreduce (``slipstream bench comm``, benchmarks/results/finetune_*.md).
"""

from __future__ import annotations

import functools

import torch

from ..._common.patch import is_patched as _is_patched, patch, uninstall_all

__all__ = ["patch_zero_optimizer", "unpatch_all", "is_patched", "owner_layout"]

_METHOD = "allreduce_and_copy_with_multiple_ranks"
_OWNER = "deepspeed-zero"  # this module's patches, apart from the rest of the adapter's
# Largest padded size, relative to the bucket, still worth a reduce-scatter: an allreduce
# moves twice the bucket's bytes, so up to 1.5x padding is still cheaper across nodes.
MAX_PADDING = 1.5


def owner_layout(numels: list[int], owners: list, world: int) -> tuple[list[int], int, list[int]] | None:
    """Where each slice goes in the owner-by-owner layout: (offset of each slice, shard size,
    end of each owner's slices), or None when a slice has several owners or the padding would
    exceed ``MAX_PADDING``."""
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
    if total == 0 or shard * world > MAX_PADDING * total:
        return None
    filled = [r * shard for r in range(world)]
    offsets = []
    for n, owner in zip(numels, single):
        offsets.append(filled[owner])
        filled[owner] += n
    return offsets, shard, filled


def _reduce_to_owners(self, small_bucket, communication_data_type, log=None, divide=True, process_group=None,
                      bucket_ranks=None, output_bucket=None):
    """Drop-in for ``DeepSpeedZeroOptimizer.allreduce_and_copy_with_multiple_ranks``."""
    import deepspeed.comm as dist
    from deepspeed.runtime.zero import stage_1_and_2

    group = self.dp_process_group if process_group is None else process_group
    world = dist.get_world_size(group=group)
    dtype = small_bucket[0].dtype if small_bucket else None
    layout = None
    if (bucket_ranks is not None and dtype == communication_data_type and not stage_1_and_2.pg_correctness_test
            and self.sequence_parallel_size == 1 and all(t.dtype == dtype for t in small_bucket)):
        layout = owner_layout([t.numel() for t in small_bucket], list(bucket_ranks), world)
    if layout is None:
        return type(self).allreduce_and_copy_with_multiple_ranks(
            self, small_bucket, communication_data_type, log=log, divide=divide, process_group=group,
            bucket_ranks=bucket_ranks, output_bucket=output_bucket)
    offsets, shard, ends = layout
    flat = torch.empty(world * shard, dtype=dtype, device=small_bucket[0].device)
    for t, start in zip(small_bucket, offsets):
        flat[start:start + t.numel()].copy_(t.reshape(-1))
    for r, end in enumerate(ends):  # the padding
        flat[end:(r + 1) * shard].zero_()
    if divide and self.gradient_average:
        flat.div_(world)
    mine = torch.empty(shard, dtype=dtype, device=flat.device)
    dist.reduce_scatter_tensor(mine, flat, group=group)
    me = dist.get_rank(group=group)
    base = me * shard
    outputs = output_bucket if output_bucket is not None else [None] * len(small_bucket)
    for buf, start, output in zip(small_bucket, offsets, outputs):
        if base <= start < base + shard:
            synced = mine[start - base:start - base + buf.numel()].view_as(buf)
            self._add_to_grad_partition_buffer(output, synced)
            buf.copy_(synced)


def is_patched(optimizer) -> bool:
    return _is_patched(optimizer, _METHOD)


def patch_zero_optimizer(optimizer) -> bool:
    """Reduce ``optimizer``'s gradient buckets to their owners; True when patched (a stage 1/2
    ZeRO optimizer), False for anything else. Idempotent."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:  # pragma: no cover - depends on the DeepSpeed version
        return False
    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or not hasattr(DeepSpeedZeroOptimizer, _METHOD):
        return False
    patch(optimizer, _METHOD, functools.partial(_reduce_to_owners, optimizer), owner=_OWNER)
    return True


def unpatch_all() -> None:
    """Unpatch every optimizer patched in this process."""
    uninstall_all(_OWNER)
