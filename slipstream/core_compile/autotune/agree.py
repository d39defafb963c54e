"""The ranks of a compiled model agree on every decision of the search (to compile, to stop,
which strategy wins), so that they compile and stop alike: one all-reduce per decision over
the group that sees the same model."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["agree", "rank"]


def rank() -> int:
    """This process's global rank (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def agree(group, values: list, mean: bool = False) -> list:
    """The maximum (or the mean) over the ranks of ``group`` of each value (one all-reduce; no-op
    on one process). An infinite value (not measured) stays infinite either way."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    if "nccl" in dist.get_backend_config(group):
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.SUM if mean else dist.ReduceOp.MAX, group=group)
    return (t / dist.get_world_size(group) if mean else t).cpu().tolist()
