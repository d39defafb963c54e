"""Exact padding removal: the pass on Hugging Face causal LMs (``hf_model``), attention that
never crosses a sequence (``attention``), packed-batch metadata (``packing``), the collator and
samplers that build padding-free batches, the per-step token loss (``loss``) and decoder layers
compiled around the attention (``fuse``)."""
