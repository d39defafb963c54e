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

from .._common import lazy

__all__ = [
    "BACKENDS", "SUPPORTED_MODEL_TYPES", "CollatorConfig", "CompileConfig", "CompileFallbackWarning", "CompileReport",
    "FlattenCollator", "GradReduction", "PackedBatch", "TokenBalancedBatchSampler", "VarlenConfig", "apply_varlen",
    "available_backends", "balance", "best_fit_decreasing", "compile", "compile_report", "count_target_tokens",
    "global_token_count", "is_varlen_patched", "step_loss", "sum_cross_entropy", "uncompile", "unpatch_varlen",
    "varlen_attention", "varlen_patched",
]

__getattr__, __dir__ = lazy.attributes(__name__, {
    **dict.fromkeys(["BACKENDS", "available_backends", "varlen_attention"], ".varlen.attention"),
    **dict.fromkeys(["compile", "compile_report", "uncompile"], ".autotune.api"),
    **dict.fromkeys(["CompileConfig", "CompileFallbackWarning", "CompileReport"], ".autotune.config"),
    **dict.fromkeys(["CollatorConfig", "FlattenCollator", "best_fit_decreasing"], ".varlen.collator"),
    **dict.fromkeys(["GradReduction", "count_target_tokens", "global_token_count", "step_loss", "sum_cross_entropy"],
                    ".varlen.loss"),
    "PackedBatch": ".varlen.packing",
    **dict.fromkeys(["TokenBalancedBatchSampler", "balance"], ".varlen.sampler"),
    "SUPPORTED_MODEL_TYPES": ".varlen.hf_model", "VarlenConfig": ".varlen.config",
    "apply_varlen": ".varlen.hf_model:apply", "is_varlen_patched": ".varlen.hf_model:is_patched",
    "varlen_patched": ".varlen.hf_model:patched", "unpatch_varlen": ".varlen.hf_model:unpatch"})
