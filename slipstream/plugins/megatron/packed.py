"""Packed (THD) sequences for megatron-core's local attention (docs/megatron.md).

megatron-core passes ``PackedSeqParams`` (``qkv_format="thd"``, ``cu_seqlens``) only to
Transformer Engine's attention; its local ``DotProductAttention`` refuses them. Here they are
attended inside each sequence with the kernel ``slipstream.core_compile`` picks:
``PackedDotProductAttention`` and ``local_spec(...)``, or the stock class patched
(``enable_packed_attention``: what ``--slipstream-varlen`` does); ``pack_batch`` collates.

What the THD path cannot compute it refuses by name (``_check``): another ``qkv_format``, cross
attention, padded offsets that differ from the real ones (context parallelism), attention bias,
a softmax offset, sliding windows and non-causal masks.

A batch's metadata is built once, by the first attention call that sees its
``PackedSeqParams``, and read by the other layers (``_batch_context``): one read of the offsets
to the host per micro-batch (a host sync on a GPU), which checks that they cover the tokens and
gives the per-sequence ``sdpa`` its lengths. (megatron-core's own THD rotary embedding reads
them again in every layer, ``_apply_rotary_pos_emb_thd``.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ...core_compile.varlen.attention import VarlenContext, resolve_backend, varlen_attention
from ...core_compile.varlen.packing import PackedBatch
from ..._common import lazy
from ..._common.patch import is_patched, patch, uninstall_all

__all__ = ["PackedDotProductAttention", "disable_packed_attention", "enable_packed_attention", "local_spec",
           "pack_batch", "packed_attention"]

_OWNER = "megatron-varlen"


def packed_attention(module, query, key, value, attn_mask_type, attention_bias, packed_seq_params,
                     backend: str = "auto") -> torch.Tensor:
    """Causal attention inside each packed sequence, for a ``DotProductAttention`` ``module``.

    ``query``: ``(t, heads, head_dim)``, ``key``/``value``: ``(t, groups, head_dim)`` (megatron
    squeezes the batch dimension of THD inputs). Returns ``(t, heads * head_dim)``."""
    _check(module, query, attn_mask_type, attention_bias, packed_seq_params)
    config = module.config
    # megatron divides softmax_scale by the layer number under apply_query_key_layer_scaling and
    # multiplies the scores back in its softmax: the product is the scale attention uses
    scale = module.softmax_scale * (module.layer_number if config.apply_query_key_layer_scaling else 1)
    dropout = module.attention_dropout.p if module.training else 0.0
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))  # (1, heads, t, head_dim)
    ctx = _batch_context(packed_seq_params, q, backend, dropout)
    if dropout > 0 and not config.sequence_parallel:  # the stock layer's RNG for attention dropout
        from megatron.core import tensor_parallel

        with tensor_parallel.get_cuda_rng_tracker().fork():
            out = varlen_attention(q, k, v, ctx, scaling=scale, dropout=dropout)
    else:
        out = varlen_attention(q, k, v, ctx, scaling=scale, dropout=dropout)
    return out[0].reshape(query.shape[0], -1)  # (1, t, heads, head_dim) -> (t, heads * head_dim)


@dataclass(kw_only=True, eq=False)
class _Batch:
    """One micro-batch's metadata, kept while its ``PackedSeqParams`` lives."""

    cu: torch.Tensor
    """The offsets it was built from, and their version: a params object whose offsets were
    replaced or written to since is built again."""
    version: int
    packed: PackedBatch
    contexts: dict = field(default_factory=dict)
    """(backend asked, device type, dtype, grad, dropout) -> the ``VarlenContext`` of those calls."""


_BATCHES = WeakIdKeyDictionary()
"""``PackedSeqParams`` -> :class:`_Batch`. Keyed by the object (a dataclass compares by value,
and a tensor's ``==`` is elementwise), weakly: megatron builds one per micro-batch."""


def _batch_context(params, q: torch.Tensor, backend: str, dropout: float) -> VarlenContext:
    """The context every attention call of this batch shares; built by the first.

    ``q``: ``(1, heads, t, head_dim)``. Host sync: the first call reads the offsets, to check
    that they cover the ``t`` tokens (and they give ``sdpa`` its lengths)."""
    cu = params.cu_seqlens_q
    version = -1 if cu.is_inference() else cu._version  # inference tensors keep no version
    batch = _BATCHES.get(params)
    if batch is None or batch.cu is not cu or batch.version != version:
        max_seqlen = params.max_seqlen_q if isinstance(params.max_seqlen_q, int) else None
        packed = PackedBatch.from_cu_seqlens(cu, total_tokens=q.shape[2], max_seqlen=max_seqlen)
        covered = sum(packed.host_lengths())
        if covered != q.shape[2]:
            raise ValueError(f"packed_seq_params.cu_seqlens_q covers {covered} tokens; the query has {q.shape[2]}")
        batch = _BATCHES[params] = _Batch(cu=cu, version=version, packed=packed)
    key = (backend, q.device.type, q.dtype, torch.is_grad_enabled() and q.requires_grad, dropout > 0)
    ctx = batch.contexts.get(key)
    if ctx is None:
        ctx = batch.contexts[key] = VarlenContext(packed=batch.packed.to(q.device, non_blocking=True),
                                                  backend=resolve_backend(backend, q, dropout), resolved=True)
    return ctx


def _check(module, query, attn_mask_type, attention_bias, params) -> None:
    from megatron.core.transformer.enums import AttnMaskType

    def refuse(what: str) -> None:
        raise NotImplementedError(f"slipstream's packed attention (layer {module.layer_number}): {what}")

    if params.qkv_format != "thd":
        refuse(f"qkv_format {params.qkv_format!r}; it takes 'thd'")
    if query.dim() != 3:
        refuse(f"expects THD query (tokens, heads, head_dim), got shape {tuple(query.shape)}")
    q, kv = params.cu_seqlens_q, params.cu_seqlens_kv
    if q is None:
        refuse("packed_seq_params.cu_seqlens_q is None")
    if kv is not None and kv is not q and not torch.equal(kv, q):
        refuse("cu_seqlens_kv differs from cu_seqlens_q (cross attention)")
    for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        padded = getattr(params, name)
        if padded is not None and padded is not q and not torch.equal(padded, q):
            refuse(f"{name} differs from cu_seqlens_q (padded THD, as context parallelism uses: "
                   "Transformer Engine's attention)")
    if attention_bias is not None:
        refuse("attention bias")
    if getattr(module, "softmax_offset", None) is not None:
        refuse(f"softmax_type {module.config.softmax_type!r}")
    if getattr(module.scale_mask_softmax, "window_size", None) is not None:
        refuse("sliding-window attention")
    mask_type = attn_mask_type if attn_mask_type is not None else module.attn_mask_type
    if mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
        refuse(f"mask type {mask_type.name}; packed sequences here are causal")


def _packed_forward(stock):
    """``DotProductAttention.forward`` that also takes ``packed_seq_params``; padded calls go to
    ``stock``."""
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return stock(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                         attention_bias=attention_bias)
        return packed_attention(self, query, key, value, attn_mask_type, attention_bias, packed_seq_params)

    return forward


@functools.cache
def _packed_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PackedDotProductAttention(DotProductAttention):
        """megatron-core's local ``DotProductAttention`` that also takes packed (THD) sequences
        (``packed_seq_params``), computed per sequence; padded calls are the stock code."""

        forward = _packed_forward(DotProductAttention.forward)

    PackedDotProductAttention.__module__ = __name__
    return PackedDotProductAttention


__getattr__, __dir__ = lazy.attributes(__name__, {"PackedDotProductAttention": _packed_class})  # megatron's subclass


def local_spec(*args, **kwargs):
    """``get_gpt_layer_local_spec(*args, **kwargs)`` with ``PackedDotProductAttention``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(*args, **kwargs)
    attention = spec.submodules.self_attention
    attention.submodules.core_attention = _packed_class()
    return spec


def enable_packed_attention() -> None:
    """Let the stock local ``DotProductAttention`` take packed sequences (every instance, every
    spec). Idempotent; ``disable_packed_attention`` undoes it exactly."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if is_patched(DotProductAttention, "forward"):
        return
    stock = DotProductAttention.forward
    patch(DotProductAttention, "forward", functools.wraps(stock)(_packed_forward(stock)), owner=_OWNER)


def disable_packed_attention() -> None:
    uninstall_all(_OWNER)


def pack_batch(tokens: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor,
               loss_mask: torch.Tensor | None = None) -> dict:
    """A padded batch as one packed row for a megatron-core GPT with packed attention.

    ``tokens``, ``labels``, ``attention_mask`` (nonzero at real tokens, each row's real tokens
    contiguous, any padding side) and optional ``loss_mask``: ``(batch, seq)``. Returns
    ``input_ids``, ``labels``, ``loss_mask`` and ``position_ids`` of shape ``(1, t)`` (positions
    restart at 0 in each sequence) and ``packed_seq_params`` (THD, int32 offsets), the
    arguments ``GPTModel.forward`` takes; ``t`` is the number of real tokens."""
    from megatron.core.packed_seq_params import PackedSeqParams

    shapes = {name: tuple(t.shape) for name, t in (("tokens", tokens), ("labels", labels),
                                                   ("attention_mask", attention_mask)) if t is not None}
    if loss_mask is not None:
        shapes["loss_mask"] = tuple(loss_mask.shape)
    if len(set(shapes.values())) != 1 or len(shapes["tokens"]) != 2:
        raise ValueError(f"pack_batch takes (batch, seq) tensors of one shape, got {shapes}")
    packed = PackedBatch.from_attention_mask(attention_mask)
    if loss_mask is None:
        loss_mask = attention_mask
    cu = packed.cu_seqlens.to(tokens.device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=packed.max_seqlen, max_seqlen_kv=packed.max_seqlen)
    return {"input_ids": packed.unpad(tokens), "labels": packed.unpad(labels),
            "loss_mask": packed.unpad(loss_mask).float(), "position_ids": packed.position_ids.to(tokens.device),
            "packed_seq_params": params}
