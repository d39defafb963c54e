"""A tokenizer without downloads: a byte-level BPE trained locally and cached, or a user's.

:func:`build_tokenizer` trains a byte-level BPE (``tokenizers`` library) on generated alpaca
text plus the prompt templates, writes it atomically to
``$XDG_CACHE_HOME/slipstream/tokenizer/tokenizer-bpe-v<vocab>-s<seed>.json`` and reuses it
afterwards. Byte level means any text, real English included, tokenises without unknown tokens.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .._common import cache

__all__ = ["SPECIAL_TOKENS", "build_tokenizer", "default_cache_dir", "load_tokenizer", "tokenizer_source"]

BUILT_VOCAB = 8192
"""The vocabulary of the tokenizer built locally where none is given."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any of these in a model directory: it holds its tokenizer."""

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}
_TRAIN_RECORDS = 4000


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/slipstream/tokenizer`` (``~/.cache/...`` without it)."""
    return cache.cache_dir("tokenizer")


def build_tokenizer(vocab_size: int = BUILT_VOCAB, *, seed: int = 0, cache_dir: str | Path | None = None) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` with ``<pad>`` = 0, ``<s>``, ``</s>``."""
    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 bytes + specials + merges), got {vocab_size}")
    from transformers import PreTrainedTokenizerFast

    path = Path(cache_dir or default_cache_dir()) / f"tokenizer-bpe-v{vocab_size}-s{seed}.json"
    if not path.exists():
        _train(vocab_size, seed, path)
    return PreTrainedTokenizerFast(tokenizer_file=str(path), **SPECIAL_TOKENS)


def _train(vocab_size: int, seed: int, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from .alpaca import PROMPT_NO_INPUT, PROMPT_WITH_INPUT, generate_alpaca

    def corpus():
        for rec in generate_alpaca(_TRAIN_RECORDS, seed=seed):
            yield PROMPT_WITH_INPUT.format(**rec) + rec["output"]
        yield PROMPT_NO_INPUT

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    cache.write_atomic(path, tok.save)  # concurrent builders (test workers, ranks) never read half a file


def load_tokenizer(path: str | None = None, *, vocab_size: int = BUILT_VOCAB,
                   cache_dir: str | Path | None = None) -> Any:
    """The tokenizer in local directory or file ``path`` (offline), or the built one."""
    if path is None:
        return build_tokenizer(vocab_size, cache_dir=cache_dir)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if os.path.isfile(path):
        tok = PreTrainedTokenizerFast(tokenizer_file=path)
    else:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_source(model: str, tokenizer: str | None) -> str | None:
    """Where a job's tokenizer comes from (``load_tokenizer``'s ``path``): ``tokenizer`` when
    given; the model directory when it holds its tokenizer; else None, the one built locally,
    which a model directory without a tokenizer takes only where its vocabulary holds the built
    one's ids (a ``ValueError`` naming ``--tokenizer`` otherwise)."""
    if tokenizer is not None or not os.path.isdir(model):
        return tokenizer
    if any((Path(model) / name).exists() for name in TOKENIZER_FILES):
        return model
    from .model import saved_config_int

    vocab = saved_config_int(model, "vocab_size")
    if vocab is not None and vocab < BUILT_VOCAB:
        raise ValueError(f"--model {model} holds no tokenizer, and its vocabulary of {vocab} tokens is smaller "
                         f"than the locally built tokenizer's {BUILT_VOCAB}: give the model's tokenizer with "
                         f"--tokenizer PATH")
    return None
