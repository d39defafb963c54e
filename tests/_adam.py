"""Comparing two training runs through Adam, with tolerances that follow from float32 rounding.

Two runs that compute the same gradients in another summation order (packed vs padded
attention, reduce-scatter vs allreduce) differ by rounding, relative to the gradient's scale.
Adam divides each gradient by its own running magnitude, so a weight's update is off by about
its gradient's relative error, times the learning rate, per step: tiny where the gradient is
far above its rounding, but up to the whole step (lr) where the gradient is within rounding of
zero, whose normalised update is noise. Hence:

- the first step's gradients, taken at the same weights, agree to 1e-5 of the largest gradient
  (float32 summation order); later steps' gradients are taken at weights that already differ
  (the near-zero gradients' updates above), so they agree to 1e-3 of the step's largest: on
  llama-tiny under ZeRO-2 with varlen against padded, 1.8e-7 at the first step and up to 1.8e-5
  at the third (AMD EPYC, 2026-11-28). A wrong reduction (a rank's share missing, a wrong scale)
  is off by the gradient's own size, far beyond either;
- weights whose every step's gradient was at least 1e4 times its measured difference agree to
  2 * steps * lr * 1e-4; every weight agrees to 2 * steps * lr (Adam's step bound);
- most weights are of the first kind, so the tight check is not vacuous.
"""

from __future__ import annotations

import torch

__all__ = ["assert_close_through_adam"]


def assert_close_through_adam(ours: list, ref: list, ours_grads: list[list], ref_grads: list[list], *,
                              lr: float, names: list[str] | None = None) -> None:
    """``ours``/``ref``: final weights (same order); ``*_grads[step][i]``: weight ``i``'s
    gradient before optimizer step ``step``; ``lr``: the largest learning rate used."""
    steps = len(ref_grads)
    assert steps and len(ours_grads) == steps, "one gradient snapshot per optimizer step in each run"
    for step, (step_ours, step_ref) in enumerate(zip(ours_grads, ref_grads)):
        scale = max(g.abs().max().item() for g in step_ref)
        within = 1e-5 if step == 0 else 1e-3
        for i, (a, b) in enumerate(zip(step_ours, step_ref)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=within * scale,
                                       msg=lambda m: f"step {step}, gradient {i}: {m}")
    clean_count = total = 0
    for i, (a, b) in enumerate(zip(ours, ref)):
        name = names[i] if names else str(i)
        g = torch.stack([step[i] for step in ref_grads])
        error = (torch.stack([step[i] for step in ours_grads]) - g).abs()
        clean = (g.abs() >= 1e4 * error).all(0) & (g.abs() > 0).all(0)
        clean_count, total = clean_count + int(clean.sum()), total + clean.numel()
        torch.testing.assert_close(a[clean], b[clean], rtol=0, atol=2 * steps * lr * 1e-4,
                                   msg=lambda m: f"{name} (gradients clear of rounding): {m}")
        torch.testing.assert_close(a, b, rtol=0, atol=2 * steps * lr, msg=lambda m: f"{name}: {m}")
    assert clean_count > total / 2, f"only {clean_count} of {total} weights had gradients clear of rounding"
