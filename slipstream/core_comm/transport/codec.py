"""Lossy wire formats for the cross-node stage (``"wire"``): what a float tensor becomes on
the link, and the error feedback that keeps a gradient's rounding from being lost.

    bf16   2 bytes an element: round to nearest even. |error| <= |x| * 2^-8; inf and NaN
           travel as they are.
    int8   1 byte an element and a float32 scale per block of ``BLOCK`` elements (4/256 bytes
           more an element): q = round(x / s), s = the block's largest finite |x| / 127.
           |error| <= s / 2; a non-finite element arrives as NaN (an overflow stays
           detectable), its block's other elements as usual.

A payload is a flat ``uint8`` tensor, the same size on every rank for the same element count
(``payload_bytes``), so peers can size their receives without a header.
"""

from __future__ import annotations

import weakref

import torch

from ..._common.patch import change

__all__ = ["BLOCK", "CODECS", "Bf16", "ErrorFeedback", "Int8"]

BLOCK = 256
"""Elements per int8 scale: 1.6% more bytes than the int8 values alone, and a scale that
follows a gradient's magnitude within a layer's slice."""
_NON_FINITE = -128  # int8 code of a NaN or inf element; values use -127..127


class Bf16:
    name = "bf16"
    dtypes = (torch.float32,)
    """Input dtypes it makes smaller (bf16 of a 2-byte dtype saves nothing)."""

    @staticmethod
    def payload_bytes(n: int) -> int:
        return 2 * n

    @staticmethod
    def encode(x: torch.Tensor) -> torch.Tensor:
        """``x: (n,)`` float -> ``(2n,)`` uint8."""
        return x.to(torch.bfloat16).view(torch.uint8)

    @staticmethod
    def decode(payload: torch.Tensor, n: int) -> torch.Tensor:
        """``(payload_bytes(n),)`` uint8 -> ``(n,)`` float32."""
        return payload.view(torch.bfloat16).float()


class Int8:
    name = "int8"
    dtypes = (torch.float32, torch.float16, torch.bfloat16)

    @staticmethod
    def payload_bytes(n: int) -> int:
        """The scales, then the values, padded to a multiple of 4 bytes: payloads laid side by
        side (an all-gather's rows) keep every row's scales aligned for a float32 view."""
        return 4 * -(-n // BLOCK) + -(-n // 4) * 4

    @staticmethod
    def encode(x: torch.Tensor) -> torch.Tensor:
        """``x: (n,)`` float -> ``(payload_bytes(n),)`` uint8: the block scales (float32),
        then the values (int8)."""
        n = x.numel()
        blocks = -(-n // BLOCK)
        payload = torch.empty(Int8.payload_bytes(n), dtype=torch.uint8)
        if not n:
            return payload
        padded = torch.zeros(blocks * BLOCK, dtype=torch.float32)
        padded[:n].copy_(x)
        finite = torch.isfinite(padded)
        rows = padded.view(blocks, BLOCK)
        scale = rows.abs().masked_fill_(~finite.view(blocks, BLOCK), 0).amax(1).div_(127)
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = rows.mul(inv[:, None]).round_().clamp_(-127, 127).view(-1)
        q.masked_fill_(~finite, _NON_FINITE)
        payload[: 4 * blocks].view(torch.float32).copy_(scale)
        payload[4 * blocks:4 * blocks + n].view(torch.int8).copy_(q[:n])
        payload[4 * blocks + n:] = 0
        return payload

    @staticmethod
    def decode(payload: torch.Tensor, n: int) -> torch.Tensor:
        blocks = -(-n // BLOCK)
        scale = payload[: 4 * blocks].view(torch.float32)
        q = payload[4 * blocks:4 * blocks + n].view(torch.int8)
        out = torch.zeros(blocks * BLOCK, dtype=torch.float32)
        out[:n].copy_(q)
        out.view(blocks, BLOCK).mul_(scale[:, None])
        out[:n].masked_fill_(q == _NON_FINITE, float("nan"))
        return out[:n]


CODECS = {c.name: c for c in (Bf16, Int8)}
"""The lossy wire formats by name (``CommConfig.wire``; ``"full"`` is none of them)."""


class ErrorFeedback:
    """What rounding took from each tensor this rank sent, added to the same tensor the next
    time it is sent (Seide et al. 2014; 1-bit Adam), so that over steps no part of a gradient
    is lost, only delayed.

    "The same tensor" is the call of the same kind and size made at the same place in the
    previous training step: the i-th call of a (kind, size) in a step takes the residual of
    the i-th in the one before. A step ends at every optimizer step (counted on this object by
    its own hook, torch's global ``register_optimizer_step_post_hook``, which every torch
    optimizer runs, DeepSpeed's and Megatron's included) or at ``next_step()``. Residuals are
    kept from the first step end on: calls outside any training loop (no optimizer step among
    them) keep nothing and get no feedback, and the first step's rounding is not carried. Past ``cap_bytes`` of residuals in
    one step, the rest of that step's rounding is not kept."""

    __slots__ = ("cap_bytes", "steps", "_step", "_stepping", "_previous", "_current", "_seen", "_bytes",
                 "__weakref__")

    def __init__(self, cap_bytes: int = 2 << 30) -> None:
        self.cap_bytes = cap_bytes
        self.steps = 0
        """Optimizer steps taken since this was made (its hook counts them)."""
        self._step = 0
        self._stepping = False  # a step has ended since this was made: residuals are paired
        self._previous: dict[tuple, torch.Tensor] = {}  # the last step's residuals
        self._current: dict[tuple, torch.Tensor] = {}
        self._seen: dict[tuple, int] = {}  # calls of each (kind, size) so far this step
        self._bytes = 0  # in _current
        _count_optimizer_steps(self)

    def next_step(self) -> None:
        """The training step ends: this step's residuals are the ones the next step takes."""
        self._previous, self._current, self._seen, self._bytes = self._current, {}, {}, 0
        self._step, self._stepping = self.steps, True

    def encode(self, codec, key: tuple, x: torch.Tensor) -> torch.Tensor:
        """``codec``'s payload of ``x`` plus the residual of the same call in the last step;
        keeps the new residual. Non-finite elements leave none (a step that overflowed must
        not poison the next)."""
        if self._step != self.steps:
            self.next_step()
        call = (*key, x.numel())
        ordinal = self._seen[call] = self._seen.get(call, -1) + 1
        key = (*call, ordinal)
        kept = self._previous.pop(key, None)
        target = x.to(torch.float32, copy=True) if kept is None else x.float() + kept
        payload = codec.encode(target)
        residual = target.sub_(codec.decode(payload, x.numel())).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        if self._stepping and self._bytes + residual.numel() * 4 <= self.cap_bytes:
            self._current[key] = residual
            self._bytes += residual.numel() * 4
        return payload

    def resident_bytes(self) -> int:
        """Bytes of the residuals kept (the last step's and this one's)."""
        return sum(r.numel() * 4 for d in (self._previous, self._current) for r in d.values())


def _count_optimizer_steps(feedback: ErrorFeedback) -> None:
    """Count optimizer steps on ``feedback`` from now on: a global step-post hook of its own
    (it holds ``feedback`` weakly and leaves with it), recorded in the patch registry
    (``status()`` lists it, ``disable()`` removes it; the hook only adds one to a counter)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    ref = weakref.ref(feedback)

    def count(*_args) -> None:
        if (alive := ref()) is not None:
            alive.steps += 1

    handle = register_optimizer_step_post_hook(count)
    weakref.finalize(feedback, handle.remove)
    change(("comm", "optimizer-step-count", id(feedback)),
           "torch.optim: a global step-post hook that counts optimizer steps for one lossy wire's "
           "error feedback (it pairs each step's calls with the last step's)", handle.remove, owner="comm",
           target=feedback)
