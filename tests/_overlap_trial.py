"""A model and a link for the ``"overlap": "auto"`` tests: backward compute and a transfer
time the test sets, as sleeps (no CPU taken), so that which mode is faster is known."""

from __future__ import annotations

import contextlib
import os
import time

import torch


class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a layer's backward compute, as long as the test says."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


WIDTH = 192
"""A layer's gradients in one bucket of its owner, laid out for 2 ranks: 296 KB, a size the
core's path takes across nodes (smaller ones may go to the stock collective)."""
LAYER = WIDTH * WIDTH + WIDTH
"""Parameters of one layer."""


class Layers(torch.nn.Module):
    """Four layers, each with ``compute_s`` of backward after its gradients are ready (the
    first's input needs no gradient: 3 such waits a step)."""

    def __init__(self, compute_s: float) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.compute_s = compute_s

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(SlowBackward.apply(x, self.compute_s)))
        return x


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)


@contextlib.contextmanager
def slow_link(delay_s: float, kind: str = "reduce_scatter"):
    """Every reduce-scatter of the core takes ``delay_s`` more (``kind="all_reduce"``: every
    all-reduce, ``delay_s`` a layer's gradients, as a link carries bytes), on the thread that
    runs it (the caller's when it blocks, the communicator's when issued asynchronously), as a
    slow link would; ``SLIPSTREAM_LINK`` names the link, as the emulated cluster does. Yields
    the list of the slowed all-reduces' element counts."""
    from slipstream.core_comm import Communicator

    name = "_all_reduce" if kind == "all_reduce" else "_resize"
    original = getattr(Communicator, name)
    calls = []

    def slowed(self, *args, **kwargs):
        if name == "_all_reduce":
            calls.append(args[1].numel())
            time.sleep(delay_s * args[1].numel() / LAYER)
        elif args[0] == "reduce_scatter":
            time.sleep(delay_s)
        return original(self, *args, **kwargs)

    setattr(Communicator, name, slowed)
    os.environ["SLIPSTREAM_LINK"] = f"{delay_s} s a {kind}"
    try:
        yield calls
    finally:
        setattr(Communicator, name, original)
        del os.environ["SLIPSTREAM_LINK"]
