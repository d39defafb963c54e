"""Decoder layers compiled around the varlen attention (``VarlenConfig(compile=True)``).

On the packed row everything in a decoder layer but attention is token-wise, and
``torch.compile`` fuses those element-wise ops. Each layer's ``forward`` becomes an instance
wrapper that calls its own forward compiled with dynamic shapes (one graph for every packed
length). The per-sequence ``sdpa`` attention (the CPU path) stays eager: dynamo stops its graph
there and resumes after it, so the per-sequence kernels and their host-side lengths never enter
a graph. A one-call attention (flash, torch's varlen, flex) is traced with the layer, which is
then one graph. The layer's floats
are traced as constants (``floats_constant``): compiled cold, a float made symbolic cost a graph
a second trace and AOT compile (llama-tiny: 6 compiles of 5 graphs).

The wrapper runs the eager forward instead:
- for calls that do not come from the varlen forward (generation runs the original forward);
- when a submodule of the layer carries forward hooks (ZeRO-3 gathers parameters in hooks:
  they would cut the graph into pieces; measured slower than eager);
- when the compiler cannot run here (no C++ compiler for the CPU, no triton for CUDA), found
  by compiling a one-line function on the layer's device once, with a warning.

Results differ from eager by float rounding only (~1e-7 relative on llama-20m's loss).
"""

from __future__ import annotations

import functools
import warnings

import torch

from ..autotune.strategy import floats_constant, has_forward_hooks

__all__ = ["fuse_layers", "unfuse_layers", "is_fused", "compiler_problem"]

_MARKER = "_slipstream_fused"


class _FusedForward:
    """A layer's ``forward``: compiled, or eager where compiling would not pay or cannot run."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer
        self.eager = layer.forward  # the class's forward, bound
        self.compiled = floats_constant(torch.compile(self.eager, dynamic=True))  # one trace per graph
        self.calls = {"compiled": 0, "eager": 0}
        setattr(self, _MARKER, True)

    def __call__(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if ("slipstream_varlen" not in kwargs  # the model's original forward (generation): eager
                or not isinstance(hidden, torch.Tensor) or has_forward_hooks(self.layer)
                or compiler_problem(hidden.device.type) is not None):
            self.calls["eager"] += 1
            return self.eager(*args, **kwargs)
        self.calls["compiled"] += 1
        return self.compiled(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def compiler_problem(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot run on ``device_type`` here, or None when it can (cached)."""
    try:
        x = torch.ones(4, device=device_type)
        torch.compile(lambda t: t * 2 + 1, dynamic=False)(x)
    except Exception as e:  # noqa: BLE001 - any failure means: run eagerly
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        warnings.warn(f"slipstream: torch.compile cannot run on {device_type} here ({reason}); "
                      "decoder layers run eagerly", stacklevel=2)
        return reason
    return None


def is_fused(layer: torch.nn.Module) -> bool:
    return getattr(vars(layer).get("forward"), _MARKER, False)


def fuse_layers(layers) -> None:
    """Give every layer of ``layers`` the compiled forward (idempotent; changes nothing when it
    raises)."""
    layers = [layer for layer in layers if not is_fused(layer)]
    for layer in layers:
        if "forward" in vars(layer):
            raise RuntimeError(f"{type(layer).__name__}.forward is already wrapped by someone else; not compiling it")
    for layer in layers:
        layer.forward = _FusedForward(layer)


def unfuse_layers(layers) -> None:
    """Remove the compiled forwards (no-op on layers without one)."""
    for layer in layers:
        if is_fused(layer):
            del layer.forward
