"""Alpaca-format instruction data: generate, load, format and tokenise.

A record is ``{"instruction": str, "input": str, "output": str}``. :func:`generate_alpaca`
makes a deterministic synthetic set whose length spread follows public alpaca data (words per
record: mean ~128, median ~96, p90 ~290, range 7..444), so padding waste is realistic without
shipping any dataset. :func:`load_alpaca` reads a user's JSON file and names the file and
the record index of anything malformed. :func:`alpaca_samples` is what the recipes and the
benchmarks train on: either, tokenised.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = ["AlpacaFormatError", "alpaca_samples", "format_prompt", "generate_alpaca", "load_alpaca", "pad_batch",
           "tokenize_alpaca"]

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)

# Word count per record ~ lognormal(ln 96, 0.82) clipped to [7, 444]: median 96, p90 ~275,
# mean ~130, close to alpaca_en_demo (mean 128, median 96, p90 291, max 444, min 7).
_MEDIAN_WORDS, _SIGMA, _MIN_WORDS, _MAX_WORDS = 96, 0.82, 7, 444

_WORDS = (
    "the of and to a in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there one all we their has been if more when will would who so no can what about "
    "some out them into time only other new people could these also first any may after two most make like "
    "over such our made how then way use between each well many because water very through work year years "
    "long good just while where those both being world three under day back used same state day great small "
    "number still part place again right large system old group example data model answer question explain "
    "write list describe give create provide following sentence text word story poem summary reason steps "
    "important help different common simple process information computer language learning health food "
    "energy environment business customer product design plan change city country history science research "
    "difference benefits ways tips ideas best three five main key factors problem solution result effect"
).split()


def generate_alpaca(n: int = 1000, *, seed: int = 0) -> list[dict[str, str]]:
    """``n`` synthetic alpaca records, the same for the same ``seed``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) for rank in range(len(_WORDS))]  # Zipf-like word frequencies
    cum = list(itertools.accumulate(weights))

    def words(k: int) -> str:
        picked = rng.choices(_WORDS, cum_weights=cum, k=k)
        text = " ".join(picked)
        return text[0].upper() + text[1:] + "." if text else ""

    records = []
    for _ in range(n):
        total = round(math.exp(rng.gauss(math.log(_MEDIAN_WORDS), _SIGMA)))
        total = min(max(total, _MIN_WORDS), _MAX_WORDS)
        n_instr = min(total - 1, rng.randint(4, 20))
        n_input = 0 if rng.random() < 0.6 else min(total - 1 - n_instr, rng.randint(3, 30))
        records.append({"instruction": words(n_instr), "input": words(n_input),
                        "output": words(total - n_instr - n_input)})
    return records


class AlpacaFormatError(ValueError):
    """A file that is not alpaca-format JSON; the message names the file and the record."""


def load_alpaca(path: str | Path) -> list[dict[str, str]]:
    """Records of an alpaca JSON file: a list of objects with string ``instruction`` and
    ``output`` and an optional string ``input``."""
    path = Path(path)
    if not path.exists():
        raise AlpacaFormatError(f"{path}: no such file")
    if not path.is_file():
        raise AlpacaFormatError(f"{path}: not a file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise AlpacaFormatError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise AlpacaFormatError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, list):
        raise AlpacaFormatError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
    records = []
    for i, rec in enumerate(data):
        if not isinstance(rec, dict):
            raise AlpacaFormatError(f"{path}: record {i} is a {type(rec).__name__}, not an object")
        for key in ("instruction", "output"):
            if not isinstance(rec.get(key), str):
                raise AlpacaFormatError(f"{path}: record {i} needs a string {key!r}, got {rec.get(key)!r:.60}")
        if not isinstance(rec.get("input", ""), str):
            raise AlpacaFormatError(f"{path}: record {i} has a non-string 'input'")
        records.append({"instruction": rec["instruction"], "input": rec.get("input", ""), "output": rec["output"]})
    return records


def format_prompt(record: dict[str, str]) -> str:
    """The alpaca prompt of ``record`` (everything before the response)."""
    template = PROMPT_WITH_INPUT if record.get("input") else PROMPT_NO_INPUT
    return template.format(instruction=record["instruction"], input=record.get("input", ""))


def tokenize_alpaca(records: Sequence[dict[str, str]], tokenizer: Any, *,
                    max_length: int | None = None) -> list[dict[str, list[int]]]:
    """``[{"input_ids", "labels"}]`` per record: prompt + response + EOS, prompt labels -100.

    ``tokenizer``: a Hugging Face tokenizer. ``max_length`` truncates from the end.
    """
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out = []
    for rec in records:
        prompt = tokenizer.encode(format_prompt(rec), add_special_tokens=False)
        response = tokenizer.encode(rec["output"], add_special_tokens=False) + eos
        ids = prompt + response
        labels = [-100] * len(prompt) + response
        if max_length is not None:
            ids, labels = ids[:max_length], labels[:max_length]
        out.append({"input_ids": ids, "labels": labels})
    return out


def alpaca_samples(tokenizer: Any, *, data: str | Path | None = None, samples: int = 1000, seed: int = 0,
                   max_length: int | None = None, shuffle: bool = False) -> tuple[list[dict[str, list[int]]], int]:
    """Samples of :func:`tokenize_alpaca` from alpaca file ``data``, else from ``samples``
    records generated with ``seed``: cut to ``max_length`` tokens, those left without a target
    (under 2 tokens) dropped, shuffled with ``seed`` when ``shuffle``; and how many were cut."""
    records = load_alpaca(data) if data else generate_alpaca(samples, seed=seed)
    out = tokenize_alpaca(records, tokenizer)
    cut = 0
    if max_length is not None:
        cut = sum(len(s["input_ids"]) > max_length for s in out)
        out = [{k: v[:max_length] for k, v in s.items()} for s in out]
    out = [s for s in out if len(s["input_ids"]) > 1]
    if shuffle:
        random.Random(seed).shuffle(out)
    return out, cut


def pad_batch(samples: Sequence[dict], pad_id: int) -> dict:
    """Right-padded ``(batch, longest)`` int64 ``input_ids`` / ``attention_mask`` / ``labels``
    (-100 at padding) from :func:`tokenize_alpaca`'s samples."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n] = torch.tensor(s["input_ids"])
        labels[i, :n] = torch.tensor(s["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
