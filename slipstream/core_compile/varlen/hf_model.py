"""The varlen pass: run a Hugging Face causal LM on the real tokens only.

After :func:`apply`, ``model(**batch)`` removes padding once (before the embedding, which is
the same as after it: padding rows never reach a real token's output), runs every token-wise
op on ``(1, total_tokens, hidden)``, gives rotary embeddings the per-sequence positions,
routes attention through :func:`~slipstream.core_compile.varlen.attention.varlen_attention` (never
across a sequence boundary) and computes the model's own loss on the packed labels, with
``-100`` at every sequence start. Loss and gradients equal the padded run's.

Accepted batches: a padded ``(batch, seq)`` batch with ``attention_mask``; a flattened row
from :class:`~slipstream.core_compile.varlen.collator.FlattenCollator` (``cu_seq_lens_q`` /
``max_length_q``, the keys transformers' flash-attention path uses); a flattened row with
positions restarting at 0; or an explicit ``packed=PackedBatch``. Generation-style calls
(a KV cache, ``use_cache=True``, ``logits_to_keep``, attention or hidden-state outputs) run
the original forward with the original attention implementation.

The patch is an instance-level ``forward`` plus an attention function registered in
transformers' ``AttentionInterface`` (its official extension point), named by
``_attn_implementation`` in the model's own shallow copy of its config: the config object the
model was built with is shared by every model built from it (a reference or teacher model), and
stays as it was. The original forward stays reachable (``model._slipstream_varlen.original_forward``).
transformers is imported lazily: this module works on the model object, duck-typed.

On a GPU: the collator's packed row costs no host sync (its lengths come on the host, in the
batch's ``packed``); a row given only by ``cu_seq_lens_q`` costs none with a one-call attention
(flash, torch's varlen, flex) and one with ``sdpa`` (the lengths read once per batch); a padded
batch costs one (its per-row counts); a row given only by restarting ``position_ids`` costs three
(its restarts found, read and checked). See docs/varlen.md.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..._common.patch import change, forget, patch, unpatch as unpatch_attribute
from .attention import VarlenContext, resolve_backend, varlen_attention
from .fuse import fuse_layers, unfuse_layers
from .config import VarlenConfig
from .packing import PackedBatch

__all__ = ["SUPPORTED_MODEL_TYPES", "VarlenConfig", "apply", "unpatch", "patched", "is_patched"]

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})
ATTENTION_NAME = "slipstream_varlen"
# the same function kept out of dynamo's graphs, for the per-sequence sdpa: a compiled layer's
# graph stops at the attention call. (Traced into, it stopped deeper, at the sdpa call, and
# llama-tiny's compiled layers took 6 graphs and 11 frames to compile, against 5 and 8.)
ATTENTION_NAME_UNTRACED = "slipstream_varlen_untraced"
_MARKER = "_slipstream_varlen"
_OWNER = "varlen"  # its entries in the patch registry
_GENERATION_ARGS = ("past_key_values", "use_cache", "output_attentions", "output_hidden_states")


@dataclass(kw_only=True, eq=False)
class _PatchState:
    config: VarlenConfig
    original_forward: Any  # None when the top-level forward was wrapped by another library
    original_backbone_forward: Any
    original_attn_implementation: str | None
    # the config object the model was built with (others may share it), and the model's own
    # copy that names the varlen attention: every submodule that held the one holds the other
    shared_config: Any
    own_config: Any
    # the backend per kind of call, (device type, dtype, grad, dropout) -> name: resolving looks
    # for packages, once per model rather than in every layer
    backends: dict = field(default_factory=dict)

    def __setstate__(self, state: dict) -> None:
        """A patched model unpickled in another process (a compile process) finds its attention."""
        self.__dict__.update(state)
        _register()


_resolve_untraced = None
"""``torch.compiler.disable(_resolve_packed)``, made by ``_register``."""


def _register() -> None:
    """Register the attention functions with transformers, and make ``_resolve_untraced``, once
    per process. Made when a model is patched, not on import: ``torch.compiler.disable`` imports
    dynamo, which adds a device backend to torch.distributed's map, and ``import slipstream``
    changes nothing of torch's."""
    global _resolve_untraced
    from transformers import AttentionInterface

    if _resolve_untraced is None:
        _resolve_untraced = torch.compiler.disable(_resolve_packed)
    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, _hf_attention)
        AttentionInterface.register(ATTENTION_NAME_UNTRACED, torch.compiler.disable(_hf_attention))


def is_patched(model: torch.nn.Module) -> bool:
    return _MARKER in vars(model)


def _check_supported(model: torch.nn.Module) -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(f"the varlen pass supports Hugging Face causal LMs of type "
                                  f"{sorted(SUPPORTED_MODEL_TYPES)}; got model_type={model_type!r}. Its attention "
                                  "may not honour sequence boundaries, so it is refused.")
    inner = getattr(model, "model", None)
    missing = [n for n in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(inner, n)]
    if missing or not hasattr(model, "lm_head"):
        raise NotImplementedError(f"{type(model).__name__} does not have the Llama-family layout (model.model."
                                  "{embed_tokens, layers, norm, rotary_emb}, lm_head); missing: "
                                  f"{missing or ['lm_head']}")


def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs):
    """The function registered as ``slipstream_varlen`` in transformers' ``AttentionInterface``."""
    ctx = kwargs.pop("slipstream_varlen", None)
    if ctx is None:
        raise RuntimeError("slipstream varlen attention was called without packed-sequence metadata; call the "
                           "patched model or its decoder (model.model), or unpatch the model to use its layers "
                           "directly")
    if attention_mask is not None or not getattr(module, "is_causal", True):
        raise RuntimeError("slipstream varlen attention supports causal attention without an extra mask only")
    unsupported = [k for k in ("softcap", "s_aux") if kwargs.get(k) is not None]
    if unsupported:
        raise NotImplementedError(f"slipstream varlen attention cannot honour {unsupported}")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = varlen_attention(query, key, value, ctx, scaling=scaling, sliding_window=sliding_window, dropout=dropout)
    return out, None


def apply(model: torch.nn.Module, config: VarlenConfig | None = None) -> torch.nn.Module:
    """Patch ``model`` in place for padding-free training; returns it. Idempotent.

    The decoder (``model.model``) is patched as well, so a caller that runs it directly (TRL's
    fused LM head) gets the packed run, with hidden states back in its own layout. When the
    top-level forward is already wrapped by another library (accelerate, TRL), the wrapper is
    kept and only the decoder is patched: the wrapper's LM head and loss then run on the padded
    hidden states, with the same results."""
    config = config or VarlenConfig()
    if is_patched(model):
        if vars(model)[_MARKER].config != config:
            raise ValueError("model is already patched with a different VarlenConfig; unpatch it first")
        return model
    _check_supported(model)
    if config.compile:
        fuse_layers(model.model.layers)  # first: it raises before changing anything
    _register()
    wrapped = "forward" in vars(model)  # by accelerate, TRL's fused LM head, another patch: kept
    shared = model.config
    own = copy.copy(shared)  # Llama-family configs have no sub-configs for the setter to reach
    own._attn_implementation = ATTENTION_NAME
    state = _PatchState(config=config, original_forward=None if wrapped else model.forward,
                        original_backbone_forward=model.model.forward,
                        original_attn_implementation=shared._attn_implementation, shared_config=shared,
                        own_config=own)
    _swap_config(model, shared, own)
    setattr(model, _MARKER, state)
    setattr(model.model, _MARKER, state)
    # partial, not a bound method: a copy of the model pickles (a bound method pickles by its
    # function's name, which the instance does not have)
    patch(model.model, "forward", functools.partial(_varlen_backbone_forward, model.model), owner=_OWNER)
    if not wrapped:
        patch(model, "forward", functools.partial(_varlen_forward, model), owner=_OWNER)
    ref = weakref.ref(model)
    change((_OWNER, id(model)), f"{type(model).__name__}: padding removed, attention {ATTENTION_NAME}",
           lambda: ref() is not None and unpatch(ref()), owner=_OWNER, target=model)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`apply` exactly; a no-op on an unpatched model."""
    state = vars(model).pop(_MARKER, None)
    if state is None:
        return model
    forget((_OWNER, id(model)))
    if state.original_forward is not None:
        unpatch_attribute(model, "forward")
    unpatch_attribute(model.model, "forward")
    vars(model.model).pop(_MARKER, None)
    unfuse_layers(model.model.layers)
    _swap_config(model, state.own_config, state.shared_config)
    return model


def _swap_config(model: torch.nn.Module, old, new) -> None:
    """Every submodule of ``model`` that holds the config ``old`` holds ``new`` instead."""
    for module in model.modules():
        if vars(module).get("config") is old:
            module.config = new


@contextlib.contextmanager
def patched(model: torch.nn.Module, config: VarlenConfig | None = None) -> Iterator[torch.nn.Module]:
    """``with patched(model): ...`` applies the pass and undoes it on exit (if it applied it)."""
    already = is_patched(model)
    apply(model, config)
    try:
        yield model
    finally:
        if not already:
            unpatch(model)


@contextlib.contextmanager
def _original_attention(model):
    """The model's own config names the original attention for a generation-style call."""
    own = vars(model)[_MARKER].own_config
    ours = own._attn_implementation
    own._attn_implementation = vars(model)[_MARKER].original_attn_implementation
    try:
        yield
    finally:
        own._attn_implementation = ours


def _wants_original(kwargs, logits_to_keep=0) -> bool:
    """Generation-style calls (a KV cache, extra outputs) run the original forward."""
    return bool(logits_to_keep) or any(kwargs.get(k) not in (None, False) for k in _GENERATION_ARGS)


def _resolve_packed(kwargs, attention_mask, input_ids, inputs_embeds, position_ids, *more):
    """The packed metadata for this call, whether the inputs are in padded layout, and
    ``[input_ids, inputs_embeds, position_ids, *more]`` on the packed row.

    Where the boundaries come from, in order: ``packed`` (the collator's, lengths on the host:
    copied to the device without blocking); ``cu_seq_lens_q`` with the host's ``max_length_q``
    (built on the device, no sync); restarting ``position_ids`` of one row (read on the host);
    ``attention_mask`` (one read of the per-row counts).

    Called as ``_resolve_untraced``, never traced by ``torch.compile``: a padded batch's count
    read and the packed row's data-dependent length would break a traced copy into 8 small
    graphs (llama-20m, ``dynamic=True``), each traced and compiled, one of them not cacheable
    (a ``torch.tensor`` of the lengths). Run as it is, it is one break, and its tensors are the
    next graph's inputs."""
    packed = kwargs.pop("packed", None)
    cu = kwargs.pop("cu_seq_lens_q", None)
    max_length = kwargs.pop("max_length_q", None)
    for name in ("cu_seq_lens_k", "max_length_k"):
        kwargs.pop(name, None)  # describe the same boundaries as cu_seq_lens_q
    tokens = input_ids if input_ids is not None else inputs_embeds
    tensors = [input_ids, inputs_embeds, position_ids, *more]
    if packed is None and cu is not None:
        packed = PackedBatch.from_cu_seqlens(cu, total_tokens=tokens.shape[1],
                                             max_seqlen=max_length if isinstance(max_length, int) else None)
    if packed is not None:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("a packed batch cannot also carry padding in attention_mask")
        return packed.to(tokens.device, non_blocking=True), False, tensors
    if attention_mask is None and position_ids is not None and tokens.shape[0] == 1:
        return PackedBatch.from_position_ids(position_ids), False, tensors
    if attention_mask is None:
        attention_mask = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
    packed = PackedBatch.from_attention_mask(attention_mask)
    if position_ids is not None:
        tensors[2] = position_ids.expand(packed.padded_shape)  # (1, seq) broadcasts over the batch
    return packed, True, [None if t is None else packed.unpad(t) for t in tensors]


def _varlen_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                    logits_to_keep=0, return_dict=None, **kwargs):
    """The patched ``forward``; arguments as the model's own. Logits: see ``VarlenConfig.logits``."""
    state: _PatchState = vars(self)[_MARKER]
    if _wants_original(kwargs, logits_to_keep):
        with _original_attention(self):
            return state.original_forward(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                inputs_embeds=inputs_embeds, labels=labels, logits_to_keep=logits_to_keep,
                return_dict=return_dict, **kwargs)  # fmt: skip
    for k in _GENERATION_ARGS:
        kwargs.pop(k, None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    packed, padded, (input_ids, inputs_embeds, position_ids, labels, shift_labels) = _resolve_untraced(
        kwargs, attention_mask, input_ids, inputs_embeds, position_ids, labels, shift_labels)
    hidden = _packed_hidden(self.model, state, packed, input_ids, inputs_embeds, position_ids, kwargs)
    logits = self.lm_head(hidden)
    loss = None
    if labels is not None:  # as the stock model: shift_labels alone computes no loss
        loss = _packed_loss(self, logits, packed, labels, shift_labels, num_items_in_batch)
    layout = state.config.logits
    if layout == "auto":  # packed for a training step that computes its loss
        layout = "packed" if self.training and loss is not None and torch.is_grad_enabled() else "padded"
    if padded and layout == "padded":
        logits = packed.pad(logits)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    out = CausalLMOutputWithPast(loss=loss, logits=logits)
    use_dict = getattr(self.config, "return_dict", True) if return_dict is None else return_dict
    return out if use_dict else out.to_tuple()


def _packed_hidden(inner, state: _PatchState, packed: PackedBatch, input_ids, inputs_embeds, position_ids,
                   kwargs) -> torch.Tensor:
    """The decoder's final hidden states ``(1, total_tokens, hidden)`` of a packed row."""
    hidden = inner.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    positions = packed.position_ids if position_ids is None else position_ids
    rotary = inner.rotary_emb(hidden, positions)
    layers = inner.layers[: inner.config.num_hidden_layers]
    ctx = _context(inner, state, packed, hidden, layers)
    for layer in layers:
        hidden = layer(hidden, attention_mask=None, position_embeddings=rotary, position_ids=positions,
                       slipstream_varlen=ctx, **kwargs)
    return inner.norm(hidden)


def _context(inner, state: _PatchState, packed: PackedBatch, hidden: torch.Tensor, layers) -> VarlenContext:
    """What every layer's attention gets this forward: the metadata, the backend (resolved once
    per model and kind of call) and, for FlexAttention, its masks, built here so that a traced
    layer only reads them. The model's config names the traced attention for a one-call
    backend, the untraced one for ``sdpa``.

    Checked here, not counted in the attention: a layer whose config names another attention
    (a ``set_attn_implementation`` after the patch) would attend across sequence boundaries,
    and a count kept by the attention would be state a traced layer cannot keep."""
    own = state.own_config
    for i, layer in enumerate(layers):
        if layer.self_attn.config is not own or own._attn_implementation not in (ATTENTION_NAME,
                                                                                 ATTENTION_NAME_UNTRACED):
            raise RuntimeError(f"layer {i} runs attention {layer.self_attn.config._attn_implementation!r}, not the "
                               "varlen attention: it would attend across sequence boundaries")
    dropout = getattr(inner.config, "attention_dropout", 0.0) if inner.training else 0.0
    grad = torch.is_grad_enabled() and hidden.requires_grad
    key = (hidden.device.type, hidden.dtype, grad, dropout > 0)
    backend = state.backends.get(key)
    if backend is None:
        backend = state.backends[key] = resolve_backend(state.config.backend, hidden, dropout)
    name = ATTENTION_NAME_UNTRACED if backend == "sdpa" else ATTENTION_NAME
    if own._attn_implementation != name:
        own._attn_implementation = name
    ctx = VarlenContext(packed=packed, backend=backend, resolved=True)
    if backend == "flex":
        for window in {getattr(layer.self_attn, "sliding_window", None) for layer in layers}:
            ctx.block_mask(window, hidden.device)
    return ctx


def _varlen_backbone_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                             inputs_embeds=None, use_cache=None, **kwargs):
    """The patched decoder (``model.model``) ``forward``, for callers that run the decoder
    themselves (TRL's fused LM head, a wrapped top-level forward): the same packed run,
    with the hidden states handed back in the caller's layout (padded input: padded)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    state: _PatchState = vars(self)[_MARKER]
    kwargs.update(past_key_values=past_key_values, use_cache=use_cache)
    if _wants_original(kwargs):
        with _original_attention(self):
            return state.original_backbone_forward(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                inputs_embeds=inputs_embeds, **kwargs)  # fmt: skip
    for k in (*_GENERATION_ARGS, "cache_position", "return_dict"):
        kwargs.pop(k, None)
    packed, padded, (input_ids, inputs_embeds, position_ids) = _resolve_untraced(
        kwargs, attention_mask, input_ids, inputs_embeds, position_ids)
    hidden = _packed_hidden(self, state, packed, input_ids, inputs_embeds, position_ids, kwargs)
    return BaseModelOutputWithPast(last_hidden_state=packed.pad(hidden) if padded else hidden)


def _packed_loss(model, logits, packed, labels, shift_labels, num_items_in_batch):
    """The model's own causal-LM loss on the packed row, with no target across a boundary.

    The boundaries come as a mask from the row's positions (0 at each sequence's first token),
    not as a tensor built from the host's lengths: a ``torch.tensor`` call in a compiled graph
    keeps AOTAutograd from caching it, so a compile process could not compile it for training."""
    starts = packed.position_ids.reshape(-1).eq(0)  # (total_tokens,), each non-empty sequence's first token
    if labels is not None:
        labels = labels.masked_fill(starts, -100)
    if shift_labels is not None:  # the last token of each sequence predicts the next sequence's start
        shift_labels = shift_labels.masked_fill(torch.cat([starts[1:], starts.new_zeros(1)]), -100)
    return model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size,
                               num_items_in_batch=num_items_in_batch, shift_labels=shift_labels)
