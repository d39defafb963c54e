"""slipstream's settings in FSDP's terms. No torch.distributed.fsdp or accelerate import."""

from __future__ import annotations

from ...core_comm.tuner import BucketSizes
from ...core_compile.varlen.loss import GradReduction

__all__ = ["grad_reduction", "wrap_policy_kwargs"]


def wrap_policy_kwargs(buckets: BucketSizes, element_size: int = 2) -> dict:
    """``min_num_params`` of FSDP's size-based auto-wrap policy (accelerate's
    ``fsdp_min_num_params``): units big enough for an all-gather at full bandwidth."""
    return {"min_num_params": buckets.all_gather_bytes // element_size}


def grad_reduction() -> GradReduction:
    """FSDP1/FSDP2 (and DDP) average gradients over data-parallel ranks with their default
    reduce, and leave the loss alone under accumulation."""
    return GradReduction(averages_over_dp=True, divides_by_grad_accum=False)
