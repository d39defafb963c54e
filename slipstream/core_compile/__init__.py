"""Padding removal for variable-length batches, and compile strategies chosen by measurement.

``slipstream.compile(model)`` (``autotune``) picks eager or a ``torch.compile`` strategy on the
first training steps and falls back to eager on any failure. Padding removal gives the same
loss and gradients as the padded run.

Apply the pass, collate flat, normalise the loss per step::

    from slipstream.core_compile import apply_varlen, FlattenCollator
    apply_varlen(model)                               # Llama / Qwen2 / Mistral HF causal LM
    loader = DataLoader(ds, batch_size=8, collate_fn=FlattenCollator())
    loss = model(**batch).loss                        # exact, on real tokens only
"""

from .varlen.attention import BACKENDS, available_backends, varlen_attention
from .autotune.api import compile, compile_report, uncompile
from .autotune.config import CompileConfig, CompileFallbackWarning, CompileReport
from .varlen.collator import CollatorConfig, FlattenCollator, best_fit_decreasing
from .varlen.loss import GradReduction, count_target_tokens, global_token_count, step_loss, sum_cross_entropy
from .varlen.packing import PackedBatch
from .varlen.sampler import TokenBalancedBatchSampler, balance
from .varlen.hf_model import SUPPORTED_MODEL_TYPES, VarlenConfig, apply as apply_varlen
from .varlen.hf_model import is_patched as is_varlen_patched, patched as varlen_patched, unpatch as unpatch_varlen

__all__ = [
    "BACKENDS", "SUPPORTED_MODEL_TYPES", "CollatorConfig", "CompileConfig", "CompileFallbackWarning", "CompileReport",
    "FlattenCollator", "GradReduction", "PackedBatch", "TokenBalancedBatchSampler", "VarlenConfig", "apply_varlen",
    "available_backends", "balance", "best_fit_decreasing", "compile", "compile_report", "count_target_tokens",
    "global_token_count", "is_varlen_patched", "step_loss", "sum_cross_entropy", "uncompile", "unpatch_varlen",
    "varlen_attention", "varlen_patched",
]
