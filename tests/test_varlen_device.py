"""What a GPU job meets in the varlen pass, checked on the CPU: the calls that would block the
host, the backend resolved once, a decoder layer traced as one graph, Megatron's metadata built
once per batch."""

from __future__ import annotations

import copy

import pytest
import torch

from slipstream.core_compile import FlattenCollator, PackedBatch, VarlenConfig, apply_varlen
from slipstream.core_compile.varlen import attention, hf_model
from slipstream.recipes.model import build_model

from _dist import run_ranks  # noqa: E402
from _host_sync import HostSyncCounter  # noqa: E402
from _varlen_ref import VOCAB, padded  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _model(name="llama-tiny"):
    return build_model(name, vocab_size=VOCAB, attn_implementation="sdpa", seed=1)


def _collated(lengths, seed=0):
    """The padded batch of ``lengths`` and the same samples through the flatten collator, as
    the Hugging Face ``Trainer`` hands it to the model: its tensors moved to the device (here
    the CPU), everything else as it is."""
    ids, mask, labels = padded(lengths, seed)
    row = FlattenCollator()([{"input_ids": ids[i, :n], "labels": labels[i, :n]} for i, n in enumerate(lengths)])
    row = {k: v.to("cpu") if isinstance(v, torch.Tensor) else v for k, v in row.items()}
    return (ids, mask, labels), row


def _step_syncs(model, batch):
    """The loss of one forward and backward of ``model`` on ``batch``, and the calls counted."""
    with HostSyncCounter(batch) as syncs:
        loss = model(**batch).loss
        loss.backward()
    return loss.detach(), syncs.calls


def test_the_collators_packed_row_costs_no_host_sync():
    ref = _model()
    ours = apply_varlen(copy.deepcopy(ref))
    (ids, mask, labels), row = _collated([7, 19, 3])
    loss, calls = _step_syncs(ours, row)
    assert calls == []
    torch.testing.assert_close(loss, ref(input_ids=ids, attention_mask=mask, labels=labels).loss, rtol=1e-5,
                               atol=1e-6)


def test_a_padded_batch_costs_one_host_sync_its_row_lengths():
    ref = _model()
    ours = apply_varlen(copy.deepcopy(ref))
    ids, mask, labels = padded([7, 19, 3])
    loss, calls = _step_syncs(ours, {"input_ids": ids, "attention_mask": mask, "labels": labels})
    assert len(calls) <= 1, calls
    torch.testing.assert_close(loss, ref(input_ids=ids, attention_mask=mask, labels=labels).loss, rtol=1e-5,
                               atol=1e-6)


def _one_call_kernel(query, key, value, ctx, scaling, sliding_window):
    """Stands in for a GPU's one-call kernel (flash, torch's varlen, compiled flex): one masked
    attention over the row, from device tensors only. (Eager FlexAttention compiles inside, and
    dynamo refuses to run under the counter's dispatch mode.)"""
    seq, i = ctx.packed.seq_ids, torch.arange(query.shape[2])
    allowed = (seq[:, None] == seq[None, :]) & (i[:, None] >= i[None, :])
    if sliding_window is not None:
        allowed &= i[:, None] - i[None, :] < sliding_window
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling,
                                                           enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)


def test_a_row_given_by_offsets_alone_is_described_on_the_device(monkeypatch):
    """transformers' own flash-attention keys without ``packed``: with a one-call attention the
    pass reads nothing back; the per-sequence ``sdpa`` reads the lengths once per batch (not
    once per layer)."""
    monkeypatch.setattr(attention, "_flex", _one_call_kernel)
    ref = _model()
    (ids, mask, labels), row = _collated([7, 19, 3])
    row.pop("packed", None)
    expected = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    counts = {}
    for backend in ("flex", "sdpa"):
        ours = apply_varlen(copy.deepcopy(ref), VarlenConfig(backend=backend))
        with torch.no_grad(), HostSyncCounter(row) as counted:  # FlexAttention has no CPU backward
            loss = ours(**row).loss
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        counts[backend] = counted.calls
    assert counts == {"flex": [], "sdpa": ["Tensor.tolist"]}, counts


def test_the_backend_is_resolved_once_per_model(monkeypatch):
    calls = []
    real = attention.resolve_backend

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    # where the pass calls it now, and where each attention call called it before
    monkeypatch.setattr(attention, "resolve_backend", counting)
    monkeypatch.setattr(hf_model, "resolve_backend", counting, raising=False)
    model = apply_varlen(_model())
    for seed, lengths in enumerate([[5, 9], [12, 3, 7], [20]]):
        ids, mask, labels = padded(lengths, seed)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert calls == ["auto"]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_decoder_layer_with_a_one_call_backend_traces_as_one_graph_and_recompiles_at_most_once():
    """FlexAttention (the one-call backend that runs on a CPU, without grad) inside a decoder
    layer compiled with ``fullgraph=True``: five packed lengths, one graph and at most one
    recompile (the one that makes the length symbolic); the loss is the padded model's."""
    ref = _model()
    ours = apply_varlen(copy.deepcopy(ref), VarlenConfig(backend="flex"))
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    layer = ours.model.layers[0]
    layer.forward = torch.compile(layer.forward, fullgraph=True, backend=counting_backend)
    with torch.no_grad():
        for seed, lengths in enumerate([[5, 22, 17], [9, 3], [30, 1, 12, 7], [16], [2, 40, 11]]):
            (ids, mask, labels), row = _collated(lengths, seed)
            torch.testing.assert_close(ours(**row).loss, ref(input_ids=ids, attention_mask=mask, labels=labels).loss,
                                       rtol=1e-5, atol=1e-6)
    assert 1 <= len(graphs) <= 2, [len(g.graph.nodes) for g in graphs]


def _megatron_builds(rank, world):
    """Metadata builds over one forward and backward of a two-layer GPT on a packed batch, then
    over a second batch."""
    from megatron.core import parallel_state

    from slipstream import megatron
    from test_megatron import _cpu_workarounds, _gpt, _gpt_batch, _loss_and_grads

    _cpu_workarounds()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    builds = []
    build = PackedBatch.from_cu_seqlens.__func__
    PackedBatch.from_cu_seqlens = classmethod(lambda cls, *a, **k: builds.append(1) or build(cls, *a, **k))
    model = _gpt(1, megatron.local_spec())
    tokens, labels, mask = _gpt_batch()
    counts = []
    for batch in (megatron.pack_batch(tokens, labels, mask), megatron.pack_batch(tokens[1:], labels[1:], mask[1:])):
        _loss_and_grads(model, **batch, attention_mask=None)
        counts.append(len(builds))
    parallel_state.destroy_model_parallel()
    return counts, len(model.decoder.layers)


def test_megatron_thd_metadata_is_built_once_per_batch_not_per_layer():
    pytest.importorskip("megatron.core")
    ((counts, layers),) = run_ranks(_megatron_builds, 1, timeout=240)
    assert layers > 1 and counts == [1, 2], counts
