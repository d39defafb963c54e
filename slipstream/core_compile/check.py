"""Does a compiled forward give eager's loss and gradients on this batch?

Both run on the user's batch from the same RNG state and the same buffers (a BatchNorm's
running statistics are put back after each run, so checking changes nothing the step sees).
The loss is the model's own (``output.loss``) where it has one, else a fixed random projection
of the first output tensor. Gradients are taken with ``torch.autograd.grad``: no ``.grad`` is
touched and no stack's gradient hook fires.

Tolerances (``TOLERANCES``) are relative, per the output's dtype: inductor fuses and reorders
float operations, so float32 results differ by rounding (measured ~1e-6 on the loss and up to
~1e-4 on a ResNet-50's gradient norm); bfloat16/float16 keep 8/11 bits of mantissa.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["TOLERANCES", "Mismatch", "compare"]

# dtype -> (loss, gradients): |a-b| <= tol * max(|b|, tiny); ||ga-gb|| <= tol * ||gb||.
TOLERANCES = {
    torch.float32: (1e-4, 1e-3),
    torch.float64: (1e-9, 1e-7),
    torch.bfloat16: (2e-2, 5e-2),
    torch.float16: (5e-3, 1e-2),
}


class Mismatch(Exception):
    """The candidate's loss or gradients differ from eager's beyond the dtype's tolerance."""


@contextlib.contextmanager
def same_start(model: torch.nn.Module):
    """Each run inside starts from the RNG and buffers at entry; they are put back at exit."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({b.device.index for b, _ in buffers if b.device.type == "cuda"} - {None})
    with torch.random.fork_rng(devices=devices):
        state = torch.random.get_rng_state()
        cuda = [torch.cuda.get_rng_state(d) for d in devices]

        def reset():
            torch.random.set_rng_state(state)
            for d, s in zip(devices, cuda):
                torch.cuda.set_rng_state(s, d)
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)

        try:
            yield reset
        finally:
            reset()


def _loss(output) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.float()
    first = _first_tensor(output)
    if first is None:
        raise TypeError(f"the forward returned no tensor ({type(output).__name__}); nothing to compare")
    g = torch.Generator(device="cpu").manual_seed(0)
    weights = torch.randn(first.shape, generator=g).to(first.device, torch.float32)
    return (first.float() * weights).sum() / max(first.numel(), 1)


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    for v in values:
        found = _first_tensor(v)
        if found is not None:
            return found
    return None


def _run(forward, params, args, kwargs):
    with torch.set_grad_enabled(bool(params)):
        output = forward(*args, **kwargs)
        loss = _loss(output)
        grads = torch.autograd.grad(loss, params, allow_unused=True) if params else ()
    dtype = _first_tensor(output).dtype if _first_tensor(output) is not None else torch.float32
    return loss.detach(), [g.detach() if g is not None else None for g in grads], dtype


def compare(model: torch.nn.Module, eager, candidate, args, kwargs, *, gradients: bool = True) -> float:
    """Run ``eager`` and ``candidate`` on the batch; the candidate's compile time is inside.
    Returns the gradient's relative difference; raises ``Mismatch`` beyond tolerance.
    ``gradients=False`` compares the loss only, without autograd (for a model whose hooks
    gather and reshard parameters: FSDP2, ZeRO-3; a backward would run their reductions).
    Host sync: reads the loss and gradient norms."""
    params = [p for p in model.parameters() if p.requires_grad] if gradients else []
    with same_start(model) as reset:
        ref_loss, ref_grads, dtype = _run(eager, params, args, kwargs)
        reset()
        loss, grads, _ = _run(candidate, params, args, kwargs)
    loss_tol, grad_tol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    loss_err = abs(float(loss) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-12)
    if not loss_err <= loss_tol:
        raise Mismatch(f"loss {float(loss):.8g} vs eager {float(ref_loss):.8g} (relative {loss_err:.2e} > {loss_tol:g} for {dtype})")
    diff = ref = 0.0
    for g, r in zip(grads, ref_grads):
        if (g is None) != (r is None):
            raise Mismatch("a parameter gets a gradient in one run and none in the other")
        if g is not None:
            diff += float((g.float() - r.float()).square().sum())
            ref += float(r.float().square().sum())
    grad_err = (diff ** 0.5) / max(ref ** 0.5, 1e-12)
    if not grad_err <= grad_tol:
        raise Mismatch(f"gradients differ from eager's by {grad_err:.2e} relative (> {grad_tol:g} for {dtype})")
    return grad_err
