"""Attention over a packed row that never crosses a sequence boundary.

One entry point, :func:`varlen_attention`, dispatches to a kernel:

- ``"flash"``: ``flash_attn.flash_attn_varlen_func`` (CUDA, fp16/bf16, flash-attn installed);
- ``"torch_varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16, torch >= 2.9);
- ``"flex"``: FlexAttention with a document mask built from ``seq_ids``; backward needs CUDA
  (torch refuses FlexAttention backward on CPU), so on CPU it serves no-grad passes only;
- ``"sdpa"``: exact per-sequence ``scaled_dot_product_attention``, one call per sequence; runs
  everywhere, the CPU training path.

``"auto"`` picks the first that can run the call (device, dtype, grad, dropout). A named
backend that cannot run the call raises instead of falling back: asking for a kernel and
silently getting another would hide a misconfiguration.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .packing import PackedBatch

__all__ = ["BACKENDS", "VarlenContext", "available_backends", "resolve_backend", "varlen_attention"]

BACKENDS = ("flash", "torch_varlen", "flex", "sdpa")


@dataclass(kw_only=True, eq=False)
class VarlenContext:
    """What one forward of the patched model hands to every attention call."""

    packed: PackedBatch
    """Sequence boundaries of the packed row, already on the activations' device."""
    backend: str = "auto"
    """A name from :data:`BACKENDS` or ``"auto"``."""
    calls: int = 0
    """Attention calls served, checked by the model pass: a layer that bypassed us is an error."""
    block_masks: dict = field(default_factory=dict)
    """FlexAttention block masks built this forward, per sliding window (built once, reused by layers)."""


def _why_not(backend: str, q: torch.Tensor, dropout: float) -> str | None:
    """``None`` if ``backend`` can run this call, else the reason it cannot."""
    cuda = q.device.type == "cuda"
    half = q.dtype in (torch.float16, torch.bfloat16)
    if backend == "flash":
        if not (cuda and half):
            return "flash-attn varlen needs a CUDA tensor in fp16/bf16"
        if importlib.util.find_spec("flash_attn") is None:
            return "flash-attn is not installed (pip install flash-attn)"
    elif backend == "torch_varlen":
        if not (cuda and half):
            return "torch varlen_attn needs a CUDA tensor in fp16/bf16"
        if importlib.util.find_spec("torch.nn.attention.varlen") is None:
            return "this torch has no torch.nn.attention.varlen (torch >= 2.9)"
        if dropout > 0:
            return "torch varlen_attn has no attention dropout"
        missing = {"scale", "window_size"} - _torch_varlen_params()
        if missing:
            return f"this torch's varlen_attn takes no {' or '.join(sorted(missing))} argument"
    elif backend == "flex":
        if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
            return "this torch has no FlexAttention"
        if not cuda and torch.is_grad_enabled() and q.requires_grad:
            return "FlexAttention has no backward on CPU"
        if dropout > 0:
            return "FlexAttention has no attention dropout"
    elif backend != "sdpa":
        raise ValueError(f"unknown attention backend {backend!r}; choose from {BACKENDS} or 'auto'")
    return None


def resolve_backend(backend: str, query: torch.Tensor, dropout: float = 0.0) -> str:
    """The backend that runs this call: ``backend`` itself if it can, else raise; ``auto`` picks."""
    if backend == "auto":
        order = BACKENDS if query.device.type == "cuda" else ("sdpa",)
        return next(b for b in order if _why_not(b, query, dropout) is None)
    reason = _why_not(backend, query, dropout)
    if reason is not None:
        raise RuntimeError(f"attention backend {backend!r} cannot run here: {reason}")
    return backend


def available_backends(query: torch.Tensor, dropout: float = 0.0) -> list[str]:
    """Backends able to run attention on tensors like ``query`` (device, dtype, grad)."""
    return [b for b in BACKENDS if _why_not(b, query, dropout) is None]


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ctx: VarlenContext, *,
                     scaling: float, sliding_window: int | None = None, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention inside each packed sequence.

    ``query``: ``(1, heads, total_tokens, head_dim)``; ``key``/``value``: ``(1, kv_heads,
    total_tokens, head_dim)`` with ``heads % kv_heads == 0`` (grouped-query attention). Returns
    ``(1, total_tokens, heads, head_dim)`` in the query's dtype, the layout Hugging Face
    attention functions return. ``sliding_window=W`` lets a token see itself and the ``W-1``
    tokens before it (Hugging Face's convention).
    """
    if query.shape[0] != 1 or query.shape[2] != ctx.packed.total_tokens:
        raise ValueError(f"varlen attention expects (1, heads, {ctx.packed.total_tokens}, head_dim), "
                         f"got {tuple(query.shape)}")
    backend = resolve_backend(ctx.backend, query, dropout)
    ctx.calls += 1
    if backend == "sdpa":
        return _sdpa(query, key, value, ctx.packed, scaling, sliding_window, dropout)
    if backend == "flex":
        return _flex(query, key, value, ctx, scaling, sliding_window)
    # flash kernels take (total_tokens, heads, head_dim)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    cu, n = ctx.packed.cu_seqlens, ctx.packed.max_seqlen
    if backend == "flash":
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(q, k, v, cu, cu, n, n, dropout_p=dropout, softmax_scale=scaling, causal=True,
                                     window_size=window)
    else:
        from torch.nn.attention.varlen import varlen_attn

        gqa = {}
        if q.shape[1] != k.shape[1]:
            if "enable_gqa" in _torch_varlen_params():
                gqa["enable_gqa"] = True
            else:  # e.g. torch 2.11: each key/value head repeated for its queries, as Hugging Face's repeat_kv
                k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        out = varlen_attn(q, k, v, cu, cu, n, n, scale=scaling, window_size=(window[0], 0), **gqa)
    return out.unsqueeze(0)


@functools.cache
def _torch_varlen_params() -> frozenset[str]:
    """The arguments this torch's ``varlen_attn`` takes: its first releases had neither ``scale``
    nor ``window_size``; torch 2.11's has both but no ``enable_gqa``."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """``(length, length)`` bool, True where query ``i`` may see key ``j``: ``0 <= i-j < window``."""
    i = torch.arange(length, device=device)
    dist = i.unsqueeze(1) - i.unsqueeze(0)
    return (dist >= 0) & (dist < window)


def _sdpa(query, key, value, packed, scaling, sliding_window, dropout):
    gqa = query.shape[1] != key.shape[1]
    # split, not narrow: split's backward is one cat of the per-sequence grads, where narrow's
    # would allocate and fill a full-size zero grad per sequence (profiled: 1.2 s of fill_ per
    # step on llama-20m, batch 8 of alpaca_en_demo, 2 CPU cores).
    lengths = list(packed.lengths)  # host ints: no device sync
    outs = []
    for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value))):
        length = q.shape[2]
        if length == 0:
            continue
        windowed = sliding_window is not None and length > sliding_window
        mask = _window_mask(length, sliding_window, query.device) if windowed else None
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout,
                                                   scale=scaling, enable_gqa=gqa))
    return torch.cat(outs, dim=2).transpose(1, 2)


def _flex(query, key, value, ctx, scaling, sliding_window):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = ctx.block_masks.get(sliding_window)
    if block_mask is None:
        seq_ids = ctx.packed.seq_ids

        def document_causal(b, h, q_idx, kv_idx):
            keep = (seq_ids[q_idx] == seq_ids[kv_idx]) & (q_idx >= kv_idx)
            return keep if sliding_window is None else keep & (q_idx - kv_idx < sliding_window)

        n = ctx.packed.total_tokens
        block_mask = create_block_mask(document_causal, None, None, n, n, device=query.device)
        ctx.block_masks[sliding_window] = block_mask
    out = flex_attention(query, key, value, block_mask=block_mask, scale=scaling,
                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)
