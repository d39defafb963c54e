"""The varlen pass against the padded model it replaces: loss, logits, gradients."""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys

import pytest
import torch

from slipstream.core_compile import (
    CollatorConfig,
    FlattenCollator,
    PackedBatch,
    VarlenConfig,
    apply_varlen,
    is_varlen_patched,
    unpatch_varlen,
    varlen_patched,
)
from slipstream.recipes.model import build_model

from _varlen_ref import VOCAB, assert_step_matches_padded  # noqa: E402
from _varlen_ref import grads as _grads  # noqa: E402
from _varlen_ref import padded as _padded  # noqa: E402

FAMILIES = ["llama-tiny", "qwen2-tiny", "mistral-tiny"]


def _model(name="llama-tiny", attn="sdpa"):
    return build_model(name, vocab_size=VOCAB, attn_implementation=attn, seed=1)


def _check_exact(name, lengths, *, attn="sdpa", config=None):
    ref = _model(name, attn)
    ours = copy.deepcopy(ref)
    apply_varlen(ours, config or VarlenConfig(logits="packed"))
    assert_step_matches_padded(ref, ours, lengths)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_matches_padded_model_for_each_family_and_batch_size(name, batch):
    rng = random.Random(batch)
    _check_exact(name, [rng.randint(1, 40) for _ in range(batch)])


@pytest.mark.parametrize("batch", [2, 4, 5, 6, 7])
def test_matches_padded_llama_for_more_batch_sizes(batch):
    rng = random.Random(100 + batch)
    _check_exact("llama-tiny", [rng.randint(1, 24) for _ in range(batch)])


def test_matches_padded_for_every_length_from_one_to_max():
    _check_exact("qwen2-tiny", list(range(1, 33)))  # crosses the sliding window of 16


def test_matches_padded_for_all_equal_lengths():
    _check_exact("mistral-tiny", [20] * 4)


def test_matches_padded_for_a_batch_of_one_token():
    ref, ours = _model(), _model()
    apply_varlen(ours)
    ids = torch.tensor([[5]])
    torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-6)


def test_matches_eager_reference_too():
    _check_exact("llama-tiny", [7, 19, 3], attn="eager")


def test_padded_logits_layout_matches_stock_logits_at_real_positions():
    ref, ours = _model(), _model()
    apply_varlen(ours, VarlenConfig(logits="padded"))
    ids, mask, _ = _padded([9, 4, 12])
    logits = ours(input_ids=ids, attention_mask=mask).logits
    assert logits.shape == (3, 12, VOCAB)
    real = mask.bool()
    torch.testing.assert_close(logits[real], ref(input_ids=ids, attention_mask=mask).logits[real], rtol=1e-4, atol=1e-5)
    assert bool((logits[~real] == 0).all())


@pytest.mark.parametrize("name", FAMILIES)
def test_collated_batch_matches_padded_model(name):
    lengths = [13, 1, 30, 7]
    ref = _model(name)
    ours = copy.deepcopy(ref)
    apply_varlen(ours)
    ids, mask, labels = _padded(lengths)
    ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    collate = FlattenCollator(CollatorConfig(pad_to_multiple_of=16))
    batch = collate([{"input_ids": ids[i, :n], "labels": labels[i, :n]} for i, n in enumerate(lengths)])
    assert batch["input_ids"].shape[1] % 16 == 0
    out = ours(**batch)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref(input_ids=ids, attention_mask=mask, labels=labels).loss, rtol=1e-5, atol=1e-6)
    ref_grads = _grads(ref)
    for n, g in _grads(ours).items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6)


def test_flattened_position_ids_alone_define_the_boundaries():
    ref, ours = _model(), _model()
    apply_varlen(ours)
    flat, packed = PackedBatch.from_sequences([torch.arange(1, 6), torch.arange(10, 13)])
    out = ours(input_ids=flat, position_ids=packed.position_ids).logits
    torch.testing.assert_close(out[0, :5], ref(input_ids=flat[:, :5]).logits[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[0, 5:], ref(input_ids=flat[:, 5:]).logits[0], rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny"])
def test_flex_document_mask_matches_padded_forward_without_grad(name):
    # FlexAttention has no CPU backward; its forward is the path checked here.
    ref = _model(name)
    ours = copy.deepcopy(ref)
    apply_varlen(ours, VarlenConfig(backend="flex"))
    ids, mask, labels = _padded([5, 22, 17])
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask, labels=labels)
        b = ref(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a.logits[mask.bool()], b.logits[mask.bool()], rtol=1e-4, atol=1e-5)


def test_unpatch_restores_the_model_bit_for_bit():
    model = _model("qwen2-tiny")
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_dict = set(vars(model))
    before_attn = model.config._attn_implementation
    ids, mask, _ = _padded([6, 3])
    before_logits = model(input_ids=ids, attention_mask=mask).logits
    apply_varlen(model)
    apply_varlen(model)  # idempotent
    assert is_varlen_patched(model) and model.config._attn_implementation != before_attn
    unpatch_varlen(model)
    assert not is_varlen_patched(model)
    assert set(vars(model)) == before_dict and model.config._attn_implementation == before_attn
    assert type(model).forward is model.forward.__func__
    for k, v in model.state_dict().items():
        assert torch.equal(v, before_state[k]), k
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before_logits)


def test_patching_one_model_leaves_another_built_from_the_same_config_as_it_was():
    """A reference or teacher model built from the same config object: the pass changes
    nothing it shares, so its forward runs as before; unpatching gives the config back."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    ours, other = transformers.LlamaForCausalLM(config), transformers.LlamaForCausalLM(config)
    ours.load_state_dict(other.state_dict())
    holders = [m for m in ours.modules() if vars(m).get("config") is config]
    assert other.config is config and len(holders) > 1
    ids, mask, labels = _padded([6, 9, 3])
    before = other(input_ids=ids, attention_mask=mask, labels=labels)
    apply_varlen(ours)
    assert config._attn_implementation == "sdpa" and all(vars(m).get("config") is config for m in other.modules()
                                                         if "config" in vars(m))
    after = other(input_ids=ids, attention_mask=mask, labels=labels)
    assert torch.equal(after.logits, before.logits) and torch.equal(after.loss, before.loss)
    packed = ours(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(packed.loss, before.loss, rtol=1e-5, atol=1e-6)
    unpatch_varlen(ours)
    assert [m for m in ours.modules() if vars(m).get("config") is config] == holders
    assert config._attn_implementation == "sdpa"
    assert torch.equal(ours(input_ids=ids, attention_mask=mask, labels=labels).logits, before.logits)


def test_an_attention_changed_after_the_patch_is_refused_not_run_across_sequences():
    model = apply_varlen(_model())
    model.config._attn_implementation = "sdpa"  # e.g. set_attn_implementation on the patched model
    ids, mask, _ = _padded([6, 3])
    with pytest.raises(RuntimeError, match="would attend across sequence boundaries"):
        model(input_ids=ids, attention_mask=mask)


def test_a_patched_model_pickles_and_its_copy_runs_packed_in_a_new_process(tmp_path):
    """What a compile process does with the model (``CompileConfig.background``): the copy finds
    its attention function registered and gives this process's loss, bit for bit."""
    model = apply_varlen(_model())
    ids, mask, _ = _padded([6, 3, 9])
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    torch.save({"model": model, "ids": ids, "mask": mask}, tmp_path / "model.pt")
    code = ("import sys, torch; job = torch.load(sys.argv[1], weights_only=False); m = job['model']; "
            "print(m.config._attn_implementation, "
            "m(input_ids=job['ids'], attention_mask=job['mask'], labels=job['ids']).loss.item().hex())")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "model.pt")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [model.config._attn_implementation, loss.item().hex()], out.stdout


def test_context_manager_patches_and_restores():
    model = _model()
    with varlen_patched(model) as m:
        assert is_varlen_patched(m)
    assert not is_varlen_patched(model)


def test_reapplying_with_another_config_is_refused():
    model = apply_varlen(_model())
    with pytest.raises(ValueError, match="different VarlenConfig"):
        apply_varlen(model, VarlenConfig(backend="flex"))


def test_unsupported_model_type_is_refused():
    model = _model()
    model.config.model_type = "gpt2"
    with pytest.raises(NotImplementedError, match="llama"):
        apply_varlen(model)


def test_unavailable_named_backend_is_refused_not_replaced():
    model = apply_varlen(_model(), VarlenConfig(backend="flash"))
    ids, mask, _ = _padded([3, 2])
    with pytest.raises(RuntimeError, match="flash"):
        model(input_ids=ids, attention_mask=mask)


def test_the_decoder_called_directly_runs_packed_and_answers_in_the_callers_layout():
    """TRL's fused LM head runs ``model.model`` itself: it gets the padded layout back."""
    ref = _model()
    ours = apply_varlen(copy.deepcopy(ref))
    ids, mask, _ = _padded([5, 22, 17])
    a = ours.model(input_ids=ids, attention_mask=mask).last_hidden_state
    b = ref.model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert a.shape == b.shape
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], rtol=1e-4, atol=1e-5)
    layer = ours.model.layers[0]
    with pytest.raises(RuntimeError, match="without packed-sequence metadata"):  # a layer alone cannot know
        layer.self_attn(torch.zeros(1, 3, ours.config.hidden_size),
                        position_embeddings=ours.model.rotary_emb(torch.zeros(1, 3, 1), torch.arange(3)[None]),
                        attention_mask=None)


def test_a_forward_wrapped_by_another_library_is_kept_and_the_decoder_runs_packed():
    ref = _model()
    ours = copy.deepcopy(ref)
    calls = []
    inner_forward = ours.forward

    def wrapper(*args, **kwargs):  # as accelerate's or TRL's instance-level wrappers
        calls.append(1)
        return inner_forward(*args, **kwargs)

    ours.forward = wrapper
    apply_varlen(ours)
    assert ours.forward is wrapper
    ids, mask, labels = _padded([9, 3, 14])
    a, b = ours(input_ids=ids, attention_mask=mask, labels=labels), ref(input_ids=ids, attention_mask=mask, labels=labels)
    assert calls and a.logits.shape == b.logits.shape
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    unpatch_varlen(ours)
    assert ours.forward is wrapper and "forward" not in vars(ours.model)


def test_generation_style_call_uses_original_forward():
    ref, ours = _model(), _model()
    apply_varlen(ours)
    ids = torch.tensor([[3, 4, 5, 6]])
    a = ours(input_ids=ids, use_cache=True)
    b = ref(input_ids=ids, use_cache=True)
    assert a.past_key_values is not None
    torch.testing.assert_close(a.logits, b.logits)


def test_gradient_checkpointing_keeps_exactness():
    ref = _model()
    ours = copy.deepcopy(ref)
    for m in (ref, ours):
        # transformers 5.24's name, and the older one (5.17 has only gradient_checkpointing_enable)
        (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
        m.train()
    apply_varlen(ours)
    ids, mask, labels = _padded([11, 4, 8])
    ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    ours(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    ref_grads = _grads(ref)
    for n, g in _grads(ours).items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama-tiny", "mistral-tiny"])  # grouped-query; and a sliding window
@pytest.mark.parametrize("backend", ["auto", "sdpa", "flex", "torch_varlen", "torch_varlen-no-enable_gqa", "flash"])
def test_bf16_gpu_backends_match_padded_sdpa(backend, name, monkeypatch):
    from slipstream.core_compile.varlen import attention

    if backend == "flash":
        pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    if backend.startswith("torch_varlen") and attention._why_not("torch_varlen", torch.ones(1, device="cuda",
                                                                                          dtype=torch.bfloat16), 0.0):
        pytest.skip("this torch's varlen_attn cannot run here")
    if backend == "torch_varlen-no-enable_gqa":  # as torch 2.11's: the key/value heads repeated instead
        backend, params = "torch_varlen", attention._torch_varlen_params()
        monkeypatch.setattr(attention, "_torch_varlen_params", lambda: params - {"enable_gqa"})
    ref = _model(name).cuda().to(torch.bfloat16)
    ours = copy.deepcopy(ref)
    apply_varlen(ours, VarlenConfig(backend=backend))
    ids, mask, labels = (t.cuda() for t in _padded([30, 5, 17, 1]))
    a = ours(input_ids=ids, attention_mask=mask, labels=labels)
    b = ref(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(a.loss, b.loss, rtol=2e-2, atol=2e-2)
    a.loss.backward()
    b.loss.backward()
    ref_grads = _grads(ref)
    for n, g in _grads(ours).items():
        torch.testing.assert_close(g.float(), ref_grads[n].float(), rtol=5e-2, atol=5e-2)


def test_caller_position_ids_are_honoured_in_padded_layout():
    ref, ours = _model(), _model()
    apply_varlen(ours)
    ids, mask, labels = _padded([6, 9])
    pos = torch.arange(9).unsqueeze(0) + 3  # shifted positions, broadcast over the batch
    a = ours(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels)
    b = ref(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)


def test_num_items_in_batch_gives_the_summed_loss_over_that_count():
    ref, ours = _model(), _model()
    apply_varlen(ours)
    ids, mask, labels = _padded([6, 9, 2])
    a = ours(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(40))
    b = ref(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(40))
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)


def test_shift_labels_in_padded_layout_are_honoured():
    ref, ours = _model(), _model()
    apply_varlen(ours)
    ids, mask, labels = _padded([6, 9, 3])
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    shift[0, 2] = -100  # differs from labels: the loss must follow shift_labels
    a = ours(input_ids=ids, attention_mask=mask, labels=labels, shift_labels=shift)
    b = ref(input_ids=ids, attention_mask=mask, labels=labels, shift_labels=shift)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)


def test_shift_labels_of_a_packed_row_stop_at_each_boundary():
    """``shift_labels`` made by shifting a packed row name the next sequence's first token as the
    target of each sequence's last token: those targets are dropped, so the loss equals the
    padded model's on the same sequences."""
    ref = _model()
    ours = apply_varlen(copy.deepcopy(ref))
    ids, mask, labels = _padded([7, 19, 4])
    flat, packed = PackedBatch.from_sequences([ids[i][mask[i].bool()] for i in range(len(ids))])
    shift = torch.nn.functional.pad(flat[:, 1:], (0, 1), value=-100)
    a = ours(input_ids=flat, position_ids=packed.position_ids, labels=flat, shift_labels=shift)
    b = ref(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)


def test_transformers_flattening_collator_batches_are_packed_sequences():
    """``DataCollatorWithFlattening`` (one row, ``position_ids`` restarting at 0 per sequence):
    the loss equals the padded model's on the same sequences."""
    transformers = pytest.importorskip("transformers")
    ref = _model()
    ours = apply_varlen(copy.deepcopy(ref))
    ids, mask, labels = _padded([7, 19, 4])
    features = [{"input_ids": ids[i][mask[i].bool()].tolist()} for i in range(len(ids))]
    flat = transformers.DataCollatorWithFlattening(return_tensors="pt")(features)
    assert flat["input_ids"].shape[0] == 1 and "attention_mask" not in flat
    a = ours(**flat)
    b = ref(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
