"""The varlen pass's settings (``"varlen"`` in a stack's slipstream section): a pure dataclass,
loaded without the pass."""

from __future__ import annotations

from dataclasses import dataclass

from ..._common.settings import Settings

__all__ = ["BACKENDS", "VarlenConfig"]

BACKENDS = ("flash", "torch_varlen", "flex", "sdpa")
"""The attention kernels of the varlen pass, fastest first (``attention.py``)."""


@dataclass(kw_only=True, frozen=True)
class VarlenConfig(Settings):
    """How the varlen pass runs."""

    backend: str = "auto"
    """Attention kernel: one of ``flash``, ``torch_varlen``, ``flex``, ``sdpa``, or ``auto``
    (the fastest that can run each call; a named one that cannot run raises)."""
    logits: str = "auto"
    """Layout of returned logits for a padded input: ``"padded"`` ``(batch, seq, vocab)`` with
    zeros at padding, as the stock model; ``"packed"`` ``(1, total_tokens, vocab)``, which
    saves a copy of the logits; ``"auto"``: packed for a training step that computes its loss
    (the loss is what the step uses), padded for every other call (evaluation,
    ``compute_metrics``, generation, a call without labels), so that callers see the stock shape."""
    compile: bool = False
    """Compile each decoder layer around the attention (``torch.compile``, dynamic shapes):
    fused element-wise ops, equal to eager up to float rounding. See :mod:`.fuse`."""

    def __post_init__(self) -> None:
        if self.backend != "auto" and self.backend not in BACKENDS:
            raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {self.backend!r}")
        if self.logits not in ("auto", "packed", "padded"):
            raise ValueError(f"logits must be 'auto', 'packed' or 'padded', got {self.logits!r}")
