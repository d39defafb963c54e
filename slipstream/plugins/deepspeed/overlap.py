"""ZeRO-1/2 gradient buckets reduced while backward goes on.

DeepSpeed reduces a full bucket of gradients inside the gradient hook that filled it, and the
rank waits for the collective; ``overlap_comm`` moves it to a side stream, which the CPU
accelerator does not have, so on a CPU the cores idle while the link works. Here a full
bucket's reduce-scatter (``zero.py``'s owner layout) is issued on the communicator's thread
and backward goes on: the bucket's buffer is set aside, a spare one takes the next
gradients, and DeepSpeed's own bookkeeping of the bucket (its loop over the bucket's
parameters: gradients copied into the partition, the others freed) runs once the reduction
is done, at the end of backward (the epilogue), bucket by bucket in the order DeepSpeed would
have run it. The same values are reduced in the same order: the results are bit-equal to the
blocking path's.

A parameter larger than a bucket is reduced the same way, in its own gradient. A bucket
DeepSpeed cannot hand over this way (CPU offload, MoE, compact partition buffers, no
reduce-scatter) first waits for the buckets in flight, then
goes through DeepSpeed's own blocking method.
"""

from __future__ import annotations

import torch

__all__ = ["Deferred"]


class Deferred:
    """The buckets of one ZeRO-1/2 optimizer whose reduction is in flight."""

    __slots__ = ("pending", "spare", "collecting")

    def __init__(self) -> None:
        self.pending: list[dict] = []
        """Buckets issued, in order: their state as DeepSpeed left it and their reductions."""
        self.spare: list[torch.Tensor] = []
        """Buffers of finished buckets, for the next buckets set aside."""
        self.collecting: list | None = None
        """While a bucket's reduction is issued: its ``(work, finish)`` pairs (``zero.py``)."""

    # ---------------------------------------------------------------- DeepSpeed's methods

    def reduce_ipg_grads(self, optimizer, comm_dtype=None) -> None:
        """``reduce_ipg_grads``: each bucket's reduction issued, or run by DeepSpeed after the
        buckets in flight where it cannot be deferred."""
        from deepspeed.runtime.zero import stage_1_and_2

        keys = optimizer.ipg_buckets.keys()
        for dtype in [comm_dtype] if comm_dtype is not None else stage_1_and_2.sort_dtypes(keys):
            bucket = optimizer.ipg_buckets[dtype]
            if bucket.elements and _deferrable(optimizer, bucket, dtype):
                self._issue(optimizer, bucket, dtype)
            else:
                self.drain(optimizer)
                type(optimizer).reduce_ipg_grads(optimizer, comm_dtype=dtype)

    def epilogue(self, optimizer) -> None:
        """``independent_gradient_partition_epilogue``: the last buckets issued, every bucket
        waited for and finished, then DeepSpeed's epilogue (its buckets are empty by then)."""
        self.reduce_ipg_grads(optimizer)
        self.drain(optimizer)
        type(optimizer).independent_gradient_partition_epilogue(optimizer)

    # ---------------------------------------------------------------- the deferral

    def _issue(self, optimizer, bucket, dtype) -> None:
        # A parameter larger than a bucket comes alone, reduced in its own gradient.
        large = optimizer.extra_large_param_to_reduce.pop(dtype, None)
        buffer = bucket.buffer[bucket.index] if large is None else None
        self.collecting = []
        try:  # DeepSpeed's own division and layout; zero.py issues each reduce-scatter async
            optimizer.average_tensor(buffer.narrow(0, 0, bucket.elements) if large is None
                                     else optimizer.get_gradient_for_reduction(large).view(-1), dtype)
            works = self.collecting
        finally:
            self.collecting = None
        self.pending.append({"dtype": dtype, "index": bucket.index, "buffer": buffer, "large": large, "works": works,
                             "fields": {name: _copy(getattr(bucket, name)) for name in _FIELDS}})
        if buffer is not None:
            bucket.buffer[bucket.index] = self._spare_like(buffer)
        bucket.clear()

    def drain(self, optimizer) -> None:
        """Wait for every bucket in flight and run DeepSpeed's bookkeeping of each, in order.
        A failed reduction raises here (the rank cannot go on with a partial gradient)."""
        while self.pending:
            entry = self.pending.pop(0)
            self._finish(optimizer, entry)
            if entry["buffer"] is not None:
                self.spare.append(entry["buffer"])

    def _finish(self, optimizer, entry: dict) -> None:
        """DeepSpeed's ``reduce_ipg_grads`` over the bucket as it was issued, with its
        ``average_tensor`` (done) replaced by the wait for the reductions."""
        dtype, index, large = entry["dtype"], entry["index"], optimizer.extra_large_param_to_reduce
        bucket = optimizer.ipg_buckets[dtype]
        live = {name: _copy(getattr(bucket, name)) for name in _FIELDS}
        live_index, live_buffer, live_large = bucket.index, bucket.buffer[index], large.pop(dtype, None)
        for name, value in entry["fields"].items():
            setattr(bucket, name, value)
        bucket.index = index
        if entry["buffer"] is not None:
            bucket.buffer[index] = entry["buffer"]
        if entry["large"] is not None:
            large[dtype] = entry["large"]
        vars(optimizer)["average_tensor"] = lambda tensor, dtype: _complete(entry["works"])
        try:
            type(optimizer).reduce_ipg_grads(optimizer, comm_dtype=dtype)
        finally:
            del vars(optimizer)["average_tensor"]
            bucket.buffer[index], bucket.index = live_buffer, live_index
            for name, value in live.items():
                setattr(bucket, name, value)
            large.pop(dtype, None)
            if live_large is not None:
                large[dtype] = live_large

    def _spare_like(self, buffer: torch.Tensor) -> torch.Tensor:
        for i, spare in enumerate(self.spare):
            if spare.shape == buffer.shape and spare.dtype == buffer.dtype and spare.device == buffer.device:
                return self.spare.pop(i)
        return torch.empty_like(buffer)


# The fields of DeepSpeed's IPG bucket that describe its current fill.
_FIELDS = ("params", "grads", "elements", "has_moe_params")


def _copy(value):
    return list(value) if isinstance(value, list) else value


def _complete(works: list) -> None:
    for work, finish in works:
        if work is not None:
            work.wait()
        finish()


def _deferrable(optimizer, bucket, dtype) -> bool:
    """Whether DeepSpeed reduces this bucket only through ``allreduce_and_copy_with_multiple_ranks``
    (patched by ``zero.py``) and copies it into the partition afterwards, from CPU memory."""
    buffer = bucket.buffer[bucket.index] if bucket.buffer else None
    return (buffer is not None and buffer.device.type == "cpu" and optimizer.contiguous_gradients
            and optimizer.reduce_scatter and optimizer.use_multi_rank_bucket_allreduce
            and not bucket.has_moe_params
            and not optimizer.cpu_offload and not getattr(optimizer, "zenflow", False)
            and not getattr(optimizer, "use_grad_accum_attribute", False)
            and not getattr(optimizer, "_offload_gradient_safety_enabled", False)
            and not any(optimizer._use_compact_grad_partition_buffer(g) for g, _, _ in bucket.params))
