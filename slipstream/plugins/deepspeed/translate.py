"""slipstream's settings in DeepSpeed's terms: ZeRO bucket sizes, the loss scaling that undoes
what ``engine.backward`` does, and the run's length a config states. No DeepSpeed import: pure
translation."""

from __future__ import annotations

from ...core_comm.tuner import BucketSizes
from ...core_compile.varlen.loss import GradReduction

__all__ = ["grad_reduction", "run_length", "zero_buckets"]


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


def run_length(ds_config: dict) -> int | None:
    """The run's steps where the config states them: its scheduler's ``total_num_steps``
    (``WarmupDecayLR``, ``WarmupCosineLR``); None otherwise."""
    scheduler = ds_config.get("scheduler")
    params = scheduler.get("params") if isinstance(scheduler, dict) else None
    steps = params.get("total_num_steps") if isinstance(params, dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None
