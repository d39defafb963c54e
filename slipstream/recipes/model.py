"""Small causal-LM configurations, randomly initialised (nothing is downloaded).

``llama-20m`` is the benchmark model (about 20M parameters with an 8k vocabulary),
``llama-125m`` its second size (hidden 768, 12 layers: about 126M with that vocabulary) and
``llama-60m`` the size between (hidden 512, 12 layers: about 59M), whose 100 Mbit/s compares
finish here where the 125M's do not; the
``*-tiny`` ones (hidden 64, 2 layers) keep tests fast and cover each family the varlen pass
supports. Any other name is taken as a local Hugging Face model directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["MODEL_CONFIGS", "build_model", "context_length", "count_parameters"]

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

# name -> (model_type, config kwargs). max_position_embeddings covers the longest alpaca
# sample with room to spare.
MODEL_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-20m": (
        "llama",
        dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
             num_key_value_heads=6, max_position_embeddings=2048),
    ),  # fmt: skip
    "llama-125m": (
        "llama",
        dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=12, max_position_embeddings=2048),
    ),  # fmt: skip
    "llama-60m": (
        "llama",
        dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
             num_key_value_heads=8, max_position_embeddings=2048),
    ),  # fmt: skip
    "llama-tiny": ("llama", dict(_TINY, max_position_embeddings=1024)),
    "qwen2-tiny": (
        "qwen2",
        # one full and one sliding-window layer, so tests exercise both attention kinds
        dict(_TINY, max_position_embeddings=1024, use_sliding_window=True, sliding_window=16, max_window_layers=1),
    ),
    "mistral-tiny": ("mistral", dict(_TINY, max_position_embeddings=1024, sliding_window=16)),
}


def build_model(name: str, *, vocab_size: int, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32,
                seed: int = 0, pad_token_id: int | None = 0) -> torch.nn.Module:
    """A causal LM: a config from :data:`MODEL_CONFIGS` with random weights (seeded), or the
    model saved in the local directory ``name`` (loaded offline)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name not in MODEL_CONFIGS:
        if not os.path.isdir(name):
            raise ValueError(f"unknown model {name!r}: not one of {sorted(MODEL_CONFIGS)} nor a local directory")
        return AutoModelForCausalLM.from_pretrained(name, local_files_only=True,
                                                    attn_implementation=attn_implementation, dtype=dtype)
    model_type, kwargs = MODEL_CONFIGS[name]
    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, pad_token_id=pad_token_id,
                                  tie_word_embeddings=False, **kwargs)
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def context_length(name: str) -> int | None:
    """The longest sequence model ``name`` (a config name or a local directory) takes, or
    None where it does not say."""
    if name in MODEL_CONFIGS:
        return MODEL_CONFIGS[name][1].get("max_position_embeddings")
    return saved_config_int(name, "max_position_embeddings")


def saved_config_int(directory: str, key: str) -> int | None:
    """``key`` of the ``config.json`` in local model directory ``directory``, where it is an
    integer; None where there is no such file or value."""
    config = Path(directory) / "config.json"
    if config.is_file():
        value = json.loads(config.read_text(encoding="utf-8")).get(key)
        return value if isinstance(value, int) else None
    return None
