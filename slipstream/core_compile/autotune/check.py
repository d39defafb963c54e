"""Does a compiled forward give eager's loss and gradients on this batch?

Both run on the user's batch from the same RNG state and the same buffers (a BatchNorm's
running statistics are put back after each run, so checking changes nothing the step sees).
The loss is the model's own (``output.loss``) where it has one, else a fixed random projection
of the first output tensor. Gradients are taken with ``torch.autograd.grad``: no ``.grad`` is
touched and no stack's gradient hook fires.

Tolerances (``TOLERANCES``) are relative, per the output's dtype: inductor fuses and reorders
float operations, so float32 results differ by rounding (measured ~1e-6 on the loss of small
MLPs and transformers); bfloat16/float16 keep 8/11 bits of mantissa.

Some models are far more sensitive to rounding than that. A randomly initialised ResNet-50 on
a batch of 8 (BatchNorm over few values per channel) has eager float32 itself 3e-4 away from a
float64 run on the loss and 3e-2 on the gradients; inductor lands 2e-5 and 3e-2 away. So a
candidate beyond the dtype's tolerance from eager is judged against the exact answer: the same
batch on a float64 copy of the model (``float64_run``). It passes if it is no further from it
than ``FLOOR_FACTOR`` (3) times eager's own distance, i.e. as accurate as eager up to a
different rounding order. Without that copy (``float64_run``), and for hooked models, the plain tolerance stands.
"""

from __future__ import annotations

import contextlib
import copy

import torch

__all__ = ["FLOAT64_MAX_BYTES", "FLOOR_FACTOR", "TOLERANCES", "Mismatch", "compare", "float64_run", "units"]

# dtype -> (loss, gradients): |a-b| <= tol * max(|b|, tiny); ||ga-gb|| <= tol * ||gb||.
TOLERANCES = {
    torch.float32: (1e-4, 1e-3),
    torch.float64: (1e-9, 1e-7),
    torch.bfloat16: (2e-2, 5e-2),
    torch.float16: (5e-3, 1e-2),
}
# a candidate may be this many times further than eager from the float64 run. On a ResNet-50
# (random init, batch 8), eager's own float32 orders (2 threads, 1 thread, channels-last) land
# 0.9-1.2x eager's distance from float64 and 1.4x that apart from each other, and inductor
# 1.3-2.0x; a wrong result (a lost term, a mis-scaled op) is orders of magnitude beyond.
FLOOR_FACTOR = 3.0
# the float64 copy is made only for models up to this size (parameters, in float64)
FLOAT64_MAX_BYTES = 2 << 30


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


def _errors(loss, grads, ref_loss, ref_grads) -> tuple[float, float]:
    """Relative distance of (loss, gradients) from (ref_loss, ref_grads), in float64."""
    loss_err = abs(float(loss) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-12)
    diff = ref = 0.0
    for g, r in zip(grads, ref_grads):
        if (g is None) != (r is None):
            raise Mismatch("a parameter gets a gradient in one run and none in the other")
        if g is not None:
            diff += float((g.double() - r.double()).square().sum())
            ref += float(r.double().square().sum())
    return loss_err, (diff ** 0.5) / max(ref ** 0.5, 1e-12)


def float64_run(model: torch.nn.Module, args, kwargs):
    """(loss, gradients) of the model's class ``forward`` on a float64 copy, floating inputs
    cast; None when the copy is too large (``FLOAT64_MAX_BYTES``) or cannot be made."""
    from torch.utils._pytree import tree_map

    if sum(p.numel() for p in model.parameters()) * 8 > FLOAT64_MAX_BYTES:
        return None
    wrapper = vars(model).pop("forward", None)  # slipstream's (or another) instance forward stays out
    try:
        twin = copy.deepcopy(model).double()
    except Exception:  # noqa: BLE001 - not every module deep-copies
        return None
    finally:
        if wrapper is not None:
            model.forward = wrapper
    cast = lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    params = [p for p in twin.parameters() if p.requires_grad]
    return _run(twin.forward, params, tree_map(cast, tuple(args)), tree_map(cast, dict(kwargs)))[:2]


def compare(model: torch.nn.Module, eager, candidate, args, kwargs, *, gradients: bool = True) -> float:
    """Run ``eager`` and ``candidate`` on the batch; the candidate's compile time is inside.
    Returns the gradient's relative difference; raises ``Mismatch`` beyond tolerance, or, with
    gradients, beyond ``FLOOR_FACTOR`` times eager's distance from the float64 run (module
    docstring). ``gradients=False`` compares the loss only, without autograd (for a model
    whose hooks gather and reshard parameters: FSDP2, ZeRO-3; a backward would run their
    reductions). Host sync: reads the loss and gradient norms."""
    params = [p for p in model.parameters() if p.requires_grad] if gradients else []
    with same_start(model) as reset:
        ref_loss, ref_grads, dtype = _run(eager, params, args, kwargs)
        reset()
        loss, grads, _ = _run(candidate, params, args, kwargs)
        loss_tol, grad_tol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
        loss_err, grad_err = _errors(loss, grads, ref_loss, ref_grads)
        if loss_err <= loss_tol and grad_err <= grad_tol:
            return grad_err
        beyond = (f"loss {float(loss):.8g} vs eager {float(ref_loss):.8g} (relative {loss_err:.2e} > {loss_tol:g} "
                  f"for {dtype})" if not loss_err <= loss_tol else
                  f"gradients differ from eager's by {grad_err:.2e} relative (> {grad_tol:g} for {dtype})")
        exact = None
        if gradients and all(e == e for e in (loss_err, grad_err)):  # NaN is never rounding
            reset()
            exact = float64_run(model, args, kwargs)
    if exact is None:
        raise Mismatch(beyond)
    errors = zip(_errors(loss, grads, *exact), _errors(ref_loss, ref_grads, *exact))
    for what, (e, f), tol in zip(("loss", "gradients"), errors, (loss_tol, grad_tol)):
        if not e <= max(tol, FLOOR_FACTOR * f):
            raise Mismatch(f"{beyond}; against a float64 run: {what} {e:.2e} off, eager's {f:.2e} "
                           f"(> {FLOOR_FACTOR:g}x)")
    return grad_err


def units(args, kwargs) -> int:
    """Elements of the batch's first tensor: step times are compared per element."""
    first = _first_tensor(list(args) + list(kwargs.values()))
    return max(first.numel(), 1) if first is not None else 1
