"""Padding removal for variable-length batches: same loss and gradients as the padded run.

Apply the pass, collate flat, normalise the loss per step::

    from slipstream.core_compile import apply_varlen, FlattenCollator
    apply_varlen(model)                               # Llama / Qwen2 / Mistral HF causal LM
    loader = DataLoader(ds, batch_size=8, collate_fn=FlattenCollator())
    loss = model(**batch).loss                        # exact, on real tokens only
"""

from .attention import BACKENDS, available_backends, varlen_attention
from .collator import CollatorConfig, FlattenCollator, best_fit_decreasing
from .loss import GradReduction, count_target_tokens, global_token_count, step_loss, sum_cross_entropy
from .packing import PackedBatch
from .sampler import TokenBalancedBatchSampler, balance
from .varlen import SUPPORTED_MODEL_TYPES, VarlenConfig
from .varlen import apply as apply_varlen
from .varlen import is_patched as is_varlen_patched
from .varlen import patched as varlen_patched
from .varlen import unpatch as unpatch_varlen

__all__ = [
    "BACKENDS",
    "SUPPORTED_MODEL_TYPES",
    "CollatorConfig",
    "FlattenCollator",
    "GradReduction",
    "PackedBatch",
    "TokenBalancedBatchSampler",
    "VarlenConfig",
    "apply_varlen",
    "available_backends",
    "balance",
    "best_fit_decreasing",
    "count_target_tokens",
    "global_token_count",
    "is_varlen_patched",
    "step_loss",
    "sum_cross_entropy",
    "unpatch_varlen",
    "varlen_attention",
    "varlen_patched",
]
