"""Decoder layers compiled around the varlen attention, against the padded eager model."""

from __future__ import annotations

import copy

import pytest
import torch

from slipstream.core_compile import VarlenConfig, apply_varlen, unpatch_varlen
from slipstream.core_compile.varlen import fuse
from slipstream.recipes.model import build_model

from _varlen_ref import VOCAB, assert_step_matches_padded  # noqa: E402
COMPILED = VarlenConfig(compile=True)

needs_compiler = pytest.mark.skipif(
    fuse.compiler_problem("cpu") is not None, reason="torch.compile cannot run on this machine's CPU"
)


def _calls(model):
    calls = {"compiled": 0, "eager": 0}
    for layer in model.model.layers:
        for k, v in vars(layer)["forward"].calls.items():
            calls[k] += v
    return calls


@needs_compiler
@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny"])
@pytest.mark.slow
def test_compiled_layers_match_the_padded_eager_model_across_lengths(name):
    ref = build_model(name, vocab_size=VOCAB, seed=1)
    ours = copy.deepcopy(ref)
    apply_varlen(ours, COMPILED)
    # three packed lengths (dynamic shapes: no recompile per length) and sequence counts
    for seed, lengths in enumerate([[7, 30, 12], [25, 3], [40, 9, 18, 2]]):
        assert_step_matches_padded(ref, ours, lengths, seed)
    calls = _calls(ours)
    assert calls == {"compiled": 3 * ref.config.num_hidden_layers, "eager": 0}


@needs_compiler
@pytest.mark.slow
def test_each_layer_graph_is_traced_and_compiled_once_across_lengths(new_compile_graphs):
    """Compiling cold, dynamo made a float symbolic under ``dynamic=True``, then specialized it
    and traced and AOT-compiled a graph a second time: 6 compiles of llama-tiny's 5 graphs."""
    torch._dynamo.reset()  # no graph of an earlier test's layers kept in this process
    counters = torch._dynamo.utils.counters
    ref = build_model("llama-tiny", vocab_size=VOCAB, seed=2)
    ours = copy.deepcopy(ref)
    apply_varlen(ours, COMPILED)
    counters.clear()
    for seed, lengths in enumerate([[11, 5, 20], [6, 31]]):
        assert_step_matches_padded(ref, ours, lengths, seed)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1 and counters["aot_autograd"]["total"] == graphs, dict(counters["aot_autograd"])


@needs_compiler
def test_layers_whose_modules_carry_forward_hooks_run_eagerly():
    ref = build_model("llama-tiny", vocab_size=VOCAB, seed=1)
    ours = copy.deepcopy(ref)
    apply_varlen(ours, COMPILED)
    seen = []
    ours.model.layers[0].mlp.register_forward_pre_hook(lambda module, args: seen.append(module))
    assert_step_matches_padded(ref, ours, [9, 14], 0)
    assert len(seen) == 1
    calls = [vars(layer)["forward"].calls for layer in ours.model.layers]
    assert calls[0] == {"compiled": 0, "eager": 1} and calls[1] == {"compiled": 1, "eager": 0}


def test_without_a_working_compiler_layers_run_eagerly_with_a_warning(monkeypatch):
    def broken(fn, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    fuse.compiler_problem.cache_clear()
    try:
        with pytest.warns(UserWarning, match="torch.compile cannot run on cpu here .*no C\\+\\+ compiler"):
            assert "no C++ compiler" in fuse.compiler_problem("cpu")
        monkeypatch.undo()
        ref = build_model("llama-tiny", vocab_size=VOCAB, seed=1)
        ours = copy.deepcopy(ref)
        apply_varlen(ours, COMPILED)
        monkeypatch.setattr(torch, "compile", broken)
        fuse.compiler_problem.cache_clear()
        with pytest.warns(UserWarning, match="decoder layers run eagerly"):
            assert_step_matches_padded(ref, ours, [5, 11], 0)
        assert _calls(ours) == {"compiled": 0, "eager": ref.config.num_hidden_layers}
    finally:
        fuse.compiler_problem.cache_clear()


def test_generation_calls_run_eagerly_and_unpatch_removes_the_compiled_forwards():
    ref = build_model("llama-tiny", vocab_size=VOCAB, seed=1)
    ours = copy.deepcopy(ref)
    apply_varlen(ours, COMPILED)
    apply_varlen(ours, COMPILED)  # idempotent
    assert all(fuse.is_fused(layer) for layer in ours.model.layers)
    ids = torch.tensor([[3, 4, 5, 6]])
    a, b = ours(input_ids=ids, use_cache=True), ref(input_ids=ids, use_cache=True)
    torch.testing.assert_close(a.logits, b.logits)
    assert _calls(ours) == {"compiled": 0, "eager": ref.config.num_hidden_layers}
    unpatch_varlen(ours)
    assert not any("forward" in vars(layer) for layer in ours.model.layers)
    assert ours.config._attn_implementation == ref.config._attn_implementation


def test_a_layer_forward_wrapped_by_someone_else_is_refused_before_any_change():
    model = build_model("llama-tiny", vocab_size=VOCAB, seed=1)
    layer = model.model.layers[1]
    layer.forward = layer.forward  # someone's wrapper
    attn = model.config._attn_implementation
    with pytest.raises(RuntimeError, match="LlamaDecoderLayer.forward is already wrapped"):
        apply_varlen(model, COMPILED)
    assert model.config._attn_implementation == attn and not fuse.is_fused(model.model.layers[0])
