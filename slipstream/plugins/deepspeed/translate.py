"""slipstream's settings in DeepSpeed's terms: ZeRO bucket sizes and the loss scaling that
undoes what ``engine.backward`` does. No DeepSpeed import: pure translation."""

from __future__ import annotations

from ...core_comm.tuner import BucketSizes
from ...core_compile.varlen.loss import GradReduction

__all__ = ["grad_reduction", "zero_buckets"]


def zero_buckets(buckets: BucketSizes, element_size: int = 2) -> dict:
    """A DeepSpeed config fragment; ZeRO counts buckets in elements (``element_size`` bytes
    each: 2 for fp16/bf16 gradients and parameters)."""
    return {"zero_optimization": {
        "reduce_bucket_size": buckets.reduce_scatter_bytes // element_size,
        "allgather_bucket_size": buckets.all_gather_bytes // element_size,
        "stage3_prefetch_bucket_size": buckets.all_gather_bytes // element_size,
    }}


def grad_reduction(scale_wrt_gas: bool = True) -> GradReduction:
    """DeepSpeed averages gradients over data-parallel ranks, and its ``backward`` divides the
    loss by the accumulation steps when ``scale_wrt_gas`` is on (its default)."""
    return GradReduction(averages_over_dp=True, divides_by_grad_accum=scale_wrt_gas)
