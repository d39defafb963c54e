"""Attention over a packed row that never crosses a sequence boundary.

One entry point, :func:`varlen_attention`, dispatches to a kernel:

- ``"flash"``: ``flash_attn.flash_attn_varlen_func`` (CUDA, fp16/bf16, flash-attn installed);
- ``"torch_varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16, torch >= 2.9);
- ``"flex"``: FlexAttention with a document mask built from ``seq_ids``. On CUDA it always runs
  compiled (eager FlexAttention computes the full ``(total, total)`` score matrix), so it needs
  triton; backward needs CUDA (torch refuses FlexAttention backward on CPU), so on CPU it serves
  no-grad passes only;
- ``"sdpa"``: exact per-sequence ``scaled_dot_product_attention``, one call per sequence; runs
  everywhere, the CPU training path. It splits the row by the host's lengths: where the batch
  was described on the device, reading them is a host sync, once per batch
  (:meth:`~slipstream.core_compile.varlen.packing.PackedBatch.host_lengths`); it is never traced.

``"auto"`` picks the first that can run the call (device, dtype, grad, dropout). A named
backend that cannot run the call raises instead of falling back: asking for a kernel and
silently getting another would hide a misconfiguration. Resolving looks for packages
(``find_spec``): the model pass resolves once per model and kind of call and hands the answer
to every layer in :class:`VarlenContext`.

The one-call backends (``flash``, ``torch_varlen``, ``flex``) read nothing from the host but the
``max_seqlen`` int, so a decoder layer that calls them traces under ``torch.compile`` as one
graph; the packed length and ``max_seqlen`` become symbolic after the first new value.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .config import BACKENDS
from .packing import PackedBatch

__all__ = ["BACKENDS", "VarlenContext", "available_backends", "resolve_backend", "varlen_attention"]


@dataclass(kw_only=True, eq=False)
class VarlenContext:
    """What one forward of the patched model hands to every attention call."""

    packed: PackedBatch
    """Sequence boundaries of the packed row, already on the activations' device."""
    backend: str = "auto"
    """A name from :data:`BACKENDS` or ``"auto"``."""
    resolved: bool = False
    """``backend`` is what :func:`resolve_backend` answered for these calls' tensors (the model
    passes resolve once); otherwise every call resolves it."""
    block_masks: dict = field(default_factory=dict)
    """FlexAttention block masks per sliding window, built once per batch (see :meth:`block_mask`)."""

    def block_mask(self, sliding_window: int | None, device: torch.device):
        """FlexAttention's mask for this batch: causal inside each sequence, and inside the
        window when there is one. Built once and kept; the model pass builds it before the
        layers run, so a traced layer only reads it. On CUDA it is built compiled: eager
        ``create_block_mask`` materialises a ``(total, total)`` boolean mask."""
        mask = self.block_masks.get(sliding_window)
        if mask is None:
            mask = _document_mask(self.packed.seq_ids, sliding_window, self.packed.total_tokens, device)
            if not torch.compiler.is_compiling():  # a traced layer keeps no state
                self.block_masks[sliding_window] = mask
        return mask


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
        if cuda and importlib.util.find_spec("triton") is None:
            return "FlexAttention runs compiled on CUDA, which needs triton"
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

    Host syncs: none with a one-call backend; ``sdpa`` reads the lengths where they are not on
    the host yet (once per batch, :meth:`PackedBatch.host_lengths`). An unresolved ``ctx``
    resolves its backend here, in every call.
    """
    if query.shape[0] != 1 or query.shape[2] != ctx.packed.total_tokens:
        raise ValueError(f"varlen attention expects (1, heads, {ctx.packed.total_tokens}, head_dim), "
                         f"got {tuple(query.shape)}")
    backend = ctx.backend if ctx.resolved else resolve_backend(ctx.backend, query, dropout)
    if dropout > 0 and backend in ("torch_varlen", "flex"):  # resolved for calls without dropout
        raise RuntimeError(f"attention backend {backend!r} has no attention dropout")
    if backend == "sdpa":
        return _sdpa_untraced()(query, key, value, ctx.packed, scaling, sliding_window, dropout)
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
    lengths = list(packed.host_lengths())  # a host sync only where the batch was built on the device
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


_SDPA_UNTRACED = None


def _sdpa_untraced():
    """``torch.compiler.disable(_sdpa)``, for a caller that compiles its attention (the model
    pass keeps the whole attention untraced for ``sdpa``): traced, the per-sequence loop would
    make the lengths constants of a graph, one graph per batch; untraced, the caller's graph
    stops before it and resumes after. Made on first use, not on import:
    ``torch.compiler.disable`` imports dynamo."""
    global _SDPA_UNTRACED
    if _SDPA_UNTRACED is None:
        _SDPA_UNTRACED = torch.compiler.disable(_sdpa)
    return _SDPA_UNTRACED


def _flex(query, key, value, ctx, scaling, sliding_window):
    from torch.nn.attention.flex_attention import flex_attention

    attend = flex_attention
    if query.device.type == "cuda" and not torch.compiler.is_compiling():
        attend = _compiled(flex_attention)  # eager, it would compute the full score matrix
    out = attend(query, key, value, block_mask=ctx.block_mask(sliding_window, query.device), scale=scaling,
                 enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)


def _document_mask(seq_ids: torch.Tensor, sliding_window: int | None, total: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    def document_causal(b, h, q_idx, kv_idx):
        keep = (seq_ids[q_idx] == seq_ids[kv_idx]) & (q_idx >= kv_idx)
        return keep if sliding_window is None else keep & (q_idx - kv_idx < sliding_window)

    build = create_block_mask
    if torch.device(device).type == "cuda" and not torch.compiler.is_compiling():
        build = _compiled(create_block_mask)
    return build(document_causal, None, None, total, total, device=device)


@functools.cache
def _compiled(fn):
    """``torch.compile(fn)``, made once per process: its graphs are cached across batches."""
    return torch.compile(fn)
