"""Recipe helpers: generated data, alpaca loading errors, tokenisation, tokenizer cache, models."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from slipstream.recipes import (
    AlpacaFormatError,
    alpaca_samples,
    build_model,
    build_tokenizer,
    count_parameters,
    format_prompt,
    generate_alpaca,
    load_alpaca,
    tokenize_alpaca,
)


def _words(rec):
    return len(" ".join(rec.values()).split())


def test_generated_data_is_deterministic_with_a_realistic_length_spread():
    data = generate_alpaca(1000, seed=0)
    assert data == generate_alpaca(1000, seed=0) and data != generate_alpaca(1000, seed=1)
    words = sorted(_words(r) for r in data)
    assert 110 <= statistics.mean(words) <= 145
    assert 85 <= statistics.median(words) <= 105
    assert 250 <= words[900] <= 320
    assert words[0] >= 7 and words[-1] <= 444


def test_load_alpaca_names_the_file_and_bad_record(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"instruction": "a", "output": "b"}, {"instruction": "c", "output": 3}]))
    with pytest.raises(AlpacaFormatError, match=r"d\.json: record 1 needs a string 'output'"):
        load_alpaca(path)
    path.write_text("{not json")
    with pytest.raises(AlpacaFormatError, match=r"d\.json: not valid JSON"):
        load_alpaca(path)
    path.write_text(json.dumps([{"instruction": "a", "output": "b"}]))
    assert load_alpaca(path) == [{"instruction": "a", "input": "", "output": "b"}]


def test_prompt_uses_the_input_section_only_when_there_is_input():
    assert "### Input:" in format_prompt({"instruction": "i", "input": "x", "output": "o"})
    assert "### Input:" not in format_prompt({"instruction": "i", "input": "", "output": "o"})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(1024, cache_dir=tmp_path_factory.mktemp("tok"))


def test_tokenizer_is_built_once_and_reloaded_from_cache(tokenizer, tmp_path_factory):
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id is not None
    text = "Describe a process of making crepes."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_tokenisation_masks_the_prompt_and_ends_with_eos(tokenizer):
    rec = {"instruction": "Say hi.", "input": "", "output": "Hi there."}
    (sample,) = tokenize_alpaca([rec], tokenizer)
    prompt_len = len(tokenizer.encode(format_prompt(rec), add_special_tokens=False))
    assert sample["labels"][:prompt_len] == [-100] * prompt_len
    assert sample["labels"][prompt_len:] == sample["input_ids"][prompt_len:]
    assert sample["input_ids"][-1] == tokenizer.eos_token_id
    (short,) = tokenize_alpaca([rec], tokenizer, max_length=5)
    assert len(short["input_ids"]) == 5


def test_alpaca_samples_cut_to_max_length_count_the_cut_and_drop_samples_without_a_target(tokenizer, tmp_path):
    full, cut = alpaca_samples(tokenizer, samples=50, seed=3)
    assert len(full) == 50 and cut == 0
    short, cut = alpaca_samples(tokenizer, samples=50, seed=3, max_length=40)
    assert cut == sum(len(s["input_ids"]) > 40 for s in full) > 0
    assert [s["input_ids"] for s in short] == [s["input_ids"][:40] for s in full]
    assert alpaca_samples(tokenizer, samples=50, seed=3, max_length=1) == ([], 50)
    mixed, _ = alpaca_samples(tokenizer, samples=50, seed=3, shuffle=True)
    assert mixed != full and sorted(map(str, mixed)) == sorted(map(str, full))
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"instruction": "a", "output": "b"}]))
    (one,), _ = alpaca_samples(tokenizer, data=str(path), samples=50)
    assert one == tokenize_alpaca(load_alpaca(path), tokenizer)[0]


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny", "mistral-tiny"])
def test_tiny_models_build_from_configs_deterministically(name):
    a, b = build_model(name, vocab_size=128, seed=0), build_model(name, vocab_size=128, seed=0)
    assert a.config.model_type == name.split("-")[0]
    assert all((p == q).all() for p, q in zip(a.parameters(), b.parameters()))


def test_benchmark_model_has_about_twenty_million_parameters():
    assert 18e6 <= count_parameters(build_model("llama-20m", vocab_size=8192)) <= 22e6


def test_the_larger_benchmark_sizes_have_about_60_and_125_million_parameters():
    with torch.device("meta"):  # counted without allocating half a gigabyte
        assert 57e6 <= count_parameters(build_model("llama-60m", vocab_size=8192)) <= 61e6
        assert 120e6 <= count_parameters(build_model("llama-125m", vocab_size=8192)) <= 130e6


def test_every_cache_lives_under_xdg_cache_home_and_kinds_keep_their_own_variable(tmp_path, monkeypatch):
    from slipstream.core_comm.tuner import default_cache_dir as tuner_dir
    from slipstream.core_compile.autotune.cache import default_dir as compile_dir
    from slipstream.recipes.tokenizer import default_cache_dir as tokenizer_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SLIPSTREAM_TUNER_DIR", raising=False)
    monkeypatch.delenv("SLIPSTREAM_COMPILE_DIR", raising=False)
    assert [tokenizer_dir(), tuner_dir(), compile_dir()] == [tmp_path / "slipstream" / k
                                                             for k in ("tokenizer", "tuner", "compile")]
    monkeypatch.setenv("SLIPSTREAM_TUNER_DIR", str(tmp_path / "mine"))
    assert tuner_dir() == tmp_path / "mine"
