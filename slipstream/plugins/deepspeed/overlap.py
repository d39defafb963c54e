"""ZeRO gradient buckets reduced while backward goes on (stages 1/2: ``Deferred``; 3: ``Deferred3``).

DeepSpeed reduces a full bucket of gradients inside the gradient hook that filled it, and the
rank waits for the collective; ``overlap_comm`` moves it to a side stream, which the CPU
accelerator does not have, so on a CPU the cores idle while the link works. Here a full
bucket's reduce-scatter (``zero.py``'s owner layout) is issued on the communicator's thread
and backward goes on: the bucket's buffer is set aside, a spare one takes the next
gradients, and DeepSpeed's own bookkeeping of the bucket (its loop over the bucket's
parameters: gradients copied into the partition, the others freed) runs once the reduction
is done, bucket by bucket in the order DeepSpeed would have run it: at the end of backward
(the epilogue), or earlier for the oldest when more than ``IN_FLIGHT_BUCKETS`` are in
flight. The same values are reduced in the same order: the results are bit-equal to the
blocking path's.

A parameter larger than a bucket is reduced the same way, in its own gradient. A bucket
DeepSpeed cannot hand over this way (CPU offload, MoE, compact partition buffers, no
reduce-scatter) first waits for the buckets in flight, then
goes through DeepSpeed's own blocking method.

ZeRO-3 reduce-scatters each full bucket inside the gradient hook as well
(``__reduce_and_partition_ipg_grads``), with DeepSpeed's own layout (``reduce_scatter_coalesced``)
but a blocking call. ``Deferred3`` lays the bucket out as that method does and issues the
reduce-scatter itself, async, through DeepSpeed's communication API (so on the core's
communicator, never through a swapped DeepSpeed function), sets the bucket's buffer aside,
and copies the reduced shards into the gradient partitions (DeepSpeed's ``partition_grads``) once the call is done: as soon as
it is, in order, while backward goes on, and at the latest when more than
``IN_FLIGHT_BUCKETS`` buckets are in flight (so a big model's gradients are not all held at
once) or at the end of backward.

Under ``"overlap": "auto"`` either deferral holds the job's ``OverlapTrial``: a step it says
blocks goes through DeepSpeed's own methods at DeepSpeed's bucket size, an overlapped one as
above at the tuner's, and the end of each step's backward times the step and sets the next.
"""

from __future__ import annotations

import torch

from ..._common.patch import patch, unpatch
from ...core_comm.tuner.overlap import OverlapTrial
from ...core_comm.work import InFlight

__all__ = ["Deferred", "Deferred3", "IN_FLIGHT_BUCKETS", "OWNER", "PREFETCH_BUCKET", "STAGE3_PRIVATE", "stage3_name"]

OWNER = "deepspeed-zero"
"""The registry's owner of the ZeRO patches (``zero.py``'s and the deferrals' own)."""

IN_FLIGHT_BUCKETS = 4
"""Buckets whose reduction may be in flight at once (ZeRO-1/2 and ZeRO-3); beyond, the oldest
is waited for and finished, so a big model's gradients are not all held twice."""


class _Spares:
    """A deferral's queue of buckets in flight (the core's ``InFlight``: at most
    ``IN_FLIGHT_BUCKETS``, one failure rule), the buffers of finished ones, and the overlap
    trial that says step by step whether buckets are deferred."""

    __slots__ = ("queue", "spare", "trial", "buckets")

    def __init__(self, trial: OverlapTrial | None = None, buckets: tuple[int, int] | None = None) -> None:
        self.queue = InFlight(IN_FLIGHT_BUCKETS)
        """Buckets issued, in order: their reductions, and DeepSpeed's bookkeeping of each."""
        self.spare: list[torch.Tensor] = []
        """Buffers of finished buckets, for the next buckets set aside."""
        self.trial = trial
        """With ``"overlap": "auto"``: the trial that says, step by step, whether buckets are
        deferred (None: always)."""
        self.buckets = buckets
        """With a trial: DeepSpeed's ``reduce_bucket_size`` for (blocking, overlapped) steps."""

    @property
    def active(self) -> bool:
        """Whether this step's buckets are reduced while backward goes on."""
        return self.trial is None or self.trial.overlap

    def _backward_done(self, optimizer) -> bool:
        """The end of a backward: where it closes a step, the trial times it and sets the next
        step's mode and bucket size. True when the size changed (the spares are dropped)."""
        if self.trial is None or not _at_boundary(optimizer):
            return False
        self.trial.step_done()  # the same point of every step on every rank
        return self.size_for_mode(optimizer)

    def size_for_mode(self, optimizer) -> bool:
        """DeepSpeed's bucket size for the trial's current mode (before the first step too: a
        cached choice is taken when the trial is made). True when it changed (the spares are
        dropped)."""
        size = self.buckets[self.trial.overlap]
        if size == optimizer.reduce_bucket_size:
            return False
        optimizer.reduce_bucket_size = size
        self.spare.clear()
        return True

    def drain(self, optimizer) -> None:
        """Wait for every bucket in flight and run DeepSpeed's bookkeeping of each, in order.
        A failed reduction raises here (the rank cannot go on with a partial gradient)."""
        self.queue.drain()

    def _push(self, optimizer, name: str, works: list, entry: dict) -> None:
        def finish() -> None:
            self._finish(optimizer, entry)
            if entry["buffer"] is not None:
                self.spare.append(entry["buffer"])

        self.queue.push(name, works, finish)

    def _finish(self, optimizer, entry: dict) -> None:
        raise NotImplementedError

    def _spare_like(self, buffer: torch.Tensor) -> torch.Tensor:
        for i, spare in enumerate(self.spare):
            if spare.shape == buffer.shape and spare.dtype == buffer.dtype and spare.device == buffer.device:
                return self.spare.pop(i)
        return torch.empty_like(buffer)


class Deferred(_Spares):
    """The buckets of one ZeRO-1/2 optimizer whose reduction is in flight."""

    __slots__ = ("collecting",)

    def __init__(self, trial: OverlapTrial | None = None, buckets: tuple[int, int] | None = None) -> None:
        super().__init__(trial, buckets)
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
            if self.active and bucket.elements and _deferrable(optimizer, bucket, dtype):
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
        self._backward_done(optimizer)  # DeepSpeed allocates the next step's buffers at their size

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
        entry = {"dtype": dtype, "index": bucket.index, "buffer": buffer, "large": large, "works": works,
                 "fields": {name: _copy(getattr(bucket, name)) for name in _FIELDS}}
        if buffer is not None:
            bucket.buffer[bucket.index] = self._spare_like(buffer)
        bucket.clear()
        self._push(optimizer, f"ZeRO-2 reduce-scatter of a {dtype} bucket", [w for w, _ in works], entry)

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
        # for this call only, and through the registry (``status()`` lists it, ``disable()``
        # undoes it): the reduction is done, what is left of DeepSpeed's method is its bookkeeping
        patch(optimizer, "average_tensor", lambda tensor, dtype: _complete(entry["works"]), owner=OWNER)
        try:
            type(optimizer).reduce_ipg_grads(optimizer, comm_dtype=dtype)
        finally:
            unpatch(optimizer, "average_tensor")
            bucket.buffer[index], bucket.index = live_buffer, live_index
            for name, value in live.items():
                setattr(bucket, name, value)
            large.pop(dtype, None)
            if live_large is not None:
                large[dtype] = live_large


class Deferred3(_Spares):
    """The gradient buckets of one ZeRO-3 optimizer whose reduce-scatter is in flight."""

    __slots__ = ("issued", "running_on", "prefetch")

    def __init__(self, trial: OverlapTrial | None = None, buckets: tuple[int, int] | None = None, *,
                 prefetch: tuple[int, int] | None = None) -> None:
        super().__init__(trial, buckets)
        self.prefetch = prefetch
        """With a trial: the parameter prefetch bucket for (blocking, overlapped) steps, set on
        DeepSpeed's coordinator with each step's mode (None: DeepSpeed's, unchanged)."""
        self.issued = 0
        """Buckets whose reduce-scatter was issued during backward."""
        self.running_on = 0
        """Of those, the ones still in flight when backward went on (the core's own state)."""

    def reduce_and_partition(self, optimizer, communication_data_type) -> None:
        """``__reduce_and_partition_ipg_grads``: the bucket's reduce-scatter issued, or run by
        DeepSpeed after the buckets in flight where it cannot be deferred (or, in a blocking
        step of the trial, is not)."""
        bucket = optimizer.ipg_buckets[communication_data_type]
        if not bucket.params:
            return
        if not (self.active and _deferrable3(optimizer, bucket, communication_data_type)):
            self.drain(optimizer)
            _stage3(optimizer, "reduce_and_partition_ipg_grads")(communication_data_type)
            return
        for param in bucket.params:  # DeepSpeed's own check, before anything is issued
            if param.grad.numel() != param.ds_numel:
                raise RuntimeError(f"{param.grad.numel()} != {param.ds_numel} Cannot reduce scatter "
                                   f"gradients whose size is not same as the params")
        params = sorted(bucket.params, key=lambda p: p.ds_id)  # DeepSpeed's order
        partitions, works = _scatter_async(optimizer, params)
        buffer = bucket.buffer
        if buffer is not None:  # the bucket's gradients are views of it until finished
            bucket.buffer = self._spare_like(buffer)
        bucket.params.clear()
        bucket.elements, bucket.process_group = 0, None
        self.issued += 1
        self.running_on += not all(work.is_completed() for work in works)
        self._push(optimizer, f"ZeRO-3 reduce-scatter of a {communication_data_type} bucket", works,
                   {"params": params, "partitions": partitions, "buffer": buffer})
        while self.queue.oldest_done():  # finished as soon as done, in order
            self.queue.pop()

    def epilogue(self, optimizer) -> None:
        """``independent_gradient_partition_epilogue``: the last buckets issued, every bucket
        finished, then DeepSpeed's epilogue (its buckets are empty by then)."""
        from deepspeed.runtime.zero import stage3

        for dtype in stage3.sort_dtypes(optimizer.ipg_buckets.keys()):
            self.reduce_and_partition(optimizer, dtype)
        self.drain(optimizer)
        type(optimizer).independent_gradient_partition_epilogue(optimizer)
        if self._backward_done(optimizer):
            self.resize_buffers(optimizer)
        self.set_prefetch(optimizer)  # the next step's forward and backward gather in its mode

    @staticmethod
    def resize_buffers(optimizer) -> None:
        """DeepSpeed allocates ZeRO-3's bucket buffers once, at the size then: the next step's,
        at the new size (every bucket is empty between steps)."""
        for dtype, bucket in optimizer.ipg_buckets.items():
            if bucket.buffer is not None:
                bucket.buffer = torch.empty(optimizer.reduce_bucket_size, dtype=dtype, device=bucket.buffer.device)

    def set_prefetch(self, optimizer) -> None:
        """The trial's current mode's prefetch bucket on DeepSpeed's coordinator."""
        if self.prefetch is not None:
            setattr(optimizer._get_param_coordinator(), PREFETCH_BUCKET, self.prefetch[self.trial.overlap])

    def _finish(self, optimizer, entry: dict) -> None:
        optimizer.partition_grads(entry["params"], entry["partitions"])


PREFETCH_BUCKET = "_PartitionedParameterCoordinator__prefetch_bucket_sz"
"""DeepSpeed's ZeRO-3 parameter prefetch bucket (elements), private to its coordinator and read
at each fetch: what the overlap trial sets step by step."""

STAGE3_PRIVATE = ("reduce_and_partition_ipg_grads",)
"""The private methods of DeepSpeed's ZeRO-3 optimizer that ``Deferred3`` calls or replaces."""


def stage3_name(name: str) -> str:
    """The name-mangled attribute of DeepSpeed's stage-3 private method ``__name``."""
    return f"_DeepSpeedZeroOptimizer_Stage3__{name}"


def _stage3(optimizer, name: str):
    """DeepSpeed's stage-3 method ``__name`` of the class, bound to ``optimizer``."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return getattr(DeepSpeedZeroOptimizer_Stage3, stage3_name(name)).__get__(optimizer)


def _scatter_async(optimizer, params: list) -> tuple[list[torch.Tensor], list]:
    """DeepSpeed's stage-3 ``__avg_scatter_grads`` of ``params`` where ``_deferrable3`` lets the
    bucket in (one dtype throughout, no pre- or post-scaling, no quantized all-to-all): its
    coalesced reduce-scatter (``reduce_scatter_coalesced``: each gradient's partitions
    interleaved rank by rank, each padded to its largest, pre-divided by the group's size),
    issued async through DeepSpeed's communication API. The views of each gradient's reduced
    partition (valid once the handles are waited for), and the handles."""
    import math

    import deepspeed.comm as dist

    check = getattr(optimizer, "_assert_same_partition_group", None)
    if check is not None:
        check(params)
    group = optimizer._get_param_partition_group(params[0])
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    grads = [p.grad.view(-1) for p in params]
    sizes = [math.ceil(g.numel() / world) for g in grads]
    if len(grads) == 1 and grads[0].numel() % world == 0:
        flat = grads[0]  # DeepSpeed's own shortcut: the gradient itself, reduced in place
    else:
        flat = torch.zeros(world * sum(sizes), dtype=grads[0].dtype, device=grads[0].device)
        at = 0
        for r in range(world):
            for grad, size in zip(grads, sizes):
                piece = grad[r * size:(r + 1) * size]
                flat[at:at + piece.numel()].copy_(piece)
                at += size
    flat.div_(world)  # DeepSpeed's pre-division
    mine = flat.chunk(world)[rank]
    work = dist.reduce_scatter_fn(mine, flat, group=group, async_op=True)
    outputs, at = [], 0
    for grad, size in zip(grads, sizes):
        outputs.append(mine.narrow(0, at, grad[rank * size:(rank + 1) * size].numel()))
        at += size
    return outputs, [] if work is None else [work]  # None: the call was made synchronously


# The fields of DeepSpeed's IPG bucket that describe its current fill.
_FIELDS = ("params", "grads", "elements", "has_moe_params")


def _at_boundary(optimizer) -> bool:
    """Whether the backward that just ended closes an accumulation (the optimizer steps next):
    DeepSpeed's optimizers answer by a method (recent versions) or an attribute (older ones)."""
    boundary = getattr(optimizer, "is_gradient_accumulation_boundary", True)
    return bool(boundary() if callable(boundary) else boundary)


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


def _deferrable3(optimizer, bucket, dtype) -> bool:
    """Whether DeepSpeed's stage-3 reduction of this bucket is its coalesced reduce-scatter
    alone, its result read only by ``partition_grads``: nothing reads the output before the
    call completes (no scaling or dtype change after it), nothing is offloaded or quantized."""
    params = bucket.params
    group = optimizer._get_param_partition_group(params[0])
    from deepspeed import comm as dist

    world = dist.get_world_size(group=group)
    averaging = getattr(optimizer, "_gradient_averaging_world_size", lambda params, world: world)(params, world)
    return ((bucket.buffer is None or bucket.buffer.device.type == "cpu") and optimizer.reduce_scatter
            and dtype == optimizer.dtype == optimizer.gradient_accumulation_dtype and averaging == world
            and not (optimizer.postscale_gradients and optimizer.gradient_predivide_factor != 1.0)
            and optimizer.all2all_process_group is None and not optimizer.enable_sanity_checks
            and not optimizer.offload_optimizer and not optimizer.offload_param
            and not getattr(optimizer, "zenflow", False)
            and all(p.grad is not None and p.grad.device.type == "cpu" for p in params))
