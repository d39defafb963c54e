"""Loss normalised by the token count of the whole optimizer step.

A per-micro-batch mean weights a token by ``1 / tokens in its micro-batch``, so the gradient
depends on how tokens were split into micro-batches and ranks. The step's loss should be

    sum over every real token of the step (all micro-steps, all data-parallel ranks) of its CE
    ---------------------------------------------------------------------------------------
                     number of real tokens in the step, globally

Each micro-step therefore backpropagates ``local_sum / global_count``, scaled to undo what
the training stack does to gradients afterwards: DDP, FSDP and DeepSpeed average gradients
over the data-parallel ranks (multiply by the DP world size to undo), and DeepSpeed's
``engine.backward`` divides the loss by the accumulation steps when ``scale_wrt_gas`` is on
(multiply by them to undo). :class:`GradReduction` describes the stack; each adapter's
``translate.grad_reduction()`` builds it (``slipstream.plugins.<stack>.translate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["GradReduction", "count_target_tokens", "global_token_count", "sum_cross_entropy", "step_loss"]

IGNORE_INDEX = -100


@dataclass(kw_only=True, frozen=True)
class GradReduction:
    """What the training stack does to the loss and gradients after ``backward``."""

    averages_over_dp: bool = True
    """Gradients are averaged (not summed) over data-parallel ranks: DDP, FSDP1/2, DeepSpeed."""
    divides_by_grad_accum: bool = False
    """The loss is divided by the accumulation steps: DeepSpeed's ``backward`` with ``scale_wrt_gas``."""


def count_target_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Tokens that are a target after the causal shift: ``labels[..., 1:] != ignore_index``.

    ``labels``: ``(batch, seq)`` padded or ``(1, total)`` packed with ``ignore_index`` at
    sequence starts (both count the same). Returns a 0-d int64 tensor on ``labels``' device.
    """
    return (labels[..., 1:] != ignore_index).sum()


def global_token_count(micro_batch_labels: Iterable[torch.Tensor], *, group: dist.ProcessGroup | None,
                       ignore_index: int = IGNORE_INDEX, device: torch.device | str | None = None) -> torch.Tensor:
    """Target tokens of a whole optimizer step: summed over this rank's micro-batches and over
    the ranks of ``group`` (one all-reduce). ``group=None`` means no data parallelism, not
    WORLD: pass ``dist.group.WORLD`` to reduce over every rank.

    Call once per step with all the step's micro-batches (the HF Trainer prefetches them the
    same way). Returns a 0-d int64 tensor on ``device`` (default: the labels' device).
    """
    counts = [count_target_tokens(y, ignore_index) for y in micro_batch_labels]
    if not counts:
        raise ValueError("a step needs at least one micro-batch")
    total = torch.stack([c.to(device or counts[0].device) for c in counts]).sum()
    if group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def sum_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Summed causal-LM cross-entropy (fp32) over target tokens.

    ``logits``: ``(batch, seq, vocab)``; ``labels``: ``(batch, seq)``; the token at ``t``
    predicts the label at ``t+1``. For a packed row, labels must hold ``ignore_index`` at each
    sequence start (the collator and the varlen pass do this).
    """
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                           ignore_index=ignore_index, reduction="sum")


def step_loss(loss_sum: torch.Tensor, global_tokens: torch.Tensor | int, *, dp_world_size: int,
              grad_accum_steps: int, reduction: GradReduction) -> torch.Tensor:
    """The micro-step loss to call ``backward`` on (or hand to ``engine.backward``).

    ``loss_sum``: this micro-batch's summed loss (:func:`sum_cross_entropy`, or the model's
    loss with ``num_items_in_batch=1``); ``global_tokens``: :func:`global_token_count`. After
    the stack's own reductions the gradient is ``d(sum over the step's tokens) / global_tokens``.
    A step with no target token gives a zero loss rather than NaN.
    """
    if dp_world_size < 1 or grad_accum_steps < 1:
        raise ValueError(f"dp_world_size and grad_accum_steps must be >= 1, got {dp_world_size}, {grad_accum_steps}")
    scale = ((dp_world_size if reduction.averages_over_dp else 1)
             * (grad_accum_steps if reduction.divides_by_grad_accum else 1))
    denom = torch.as_tensor(global_tokens, device=loss_sum.device).clamp(min=1).to(loss_sum.dtype)
    return loss_sum * scale / denom
