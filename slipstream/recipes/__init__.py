"""Building blocks the recipes and benchmarks share: data, tokenizer, small models."""

from .alpaca import (AlpacaFormatError, alpaca_samples, format_prompt, generate_alpaca, load_alpaca,
                     tokenize_alpaca)
from .model import MODEL_CONFIGS, build_model, count_parameters
from .tokenizer import build_tokenizer, load_tokenizer

__all__ = ["MODEL_CONFIGS", "AlpacaFormatError", "alpaca_samples", "build_model", "build_tokenizer", "count_parameters",
           "format_prompt", "generate_alpaca", "load_alpaca", "load_tokenizer", "tokenize_alpaca"]
