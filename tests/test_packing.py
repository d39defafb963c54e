"""Packed-batch metadata, the flatten collator and best-fit-decreasing packing (pure logic)."""

from __future__ import annotations

import random

import pytest
import torch

from slipstream.core_compile import CollatorConfig, FlattenCollator, PackedBatch, best_fit_decreasing


def test_metadata_from_lengths_counts_positions_per_sequence():
    p = PackedBatch.from_lengths([3, 0, 2])
    assert p.cu_seqlens.dtype == torch.int32 and p.cu_seqlens.tolist() == [0, 3, 3, 5]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert p.seq_ids.tolist() == [0, 0, 0, 2, 2]
    assert p.max_seqlen == 3 and isinstance(p.max_seqlen, int)
    assert p.offsets == (0, 3, 3, 5) and p.total_tokens == 5 and p.num_sequences == 3


@pytest.mark.parametrize("side", ["right", "left"])
def test_unpad_then_pad_round_trips_a_padded_batch(side):
    lengths = [4, 1, 6]
    mask = (torch.arange(6).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    if side == "left":
        mask = mask.flip(1)
    x = torch.randn(3, 6, 5)
    p = PackedBatch.from_attention_mask(mask)
    assert p.lengths == (4, 1, 6)
    packed = p.unpad(x)
    assert packed.shape == (1, 11, 5)
    torch.testing.assert_close(packed[0], x[mask.bool()])
    back = p.pad(packed)
    torch.testing.assert_close(back, x * mask.unsqueeze(-1))


def test_mask_with_a_gap_inside_a_row_is_refused():
    with pytest.raises(ValueError, match="gaps"):
        PackedBatch.from_attention_mask(torch.tensor([[1, 0, 1, 0]]))


def test_from_position_ids_and_from_cu_seqlens_agree_with_from_lengths():
    ref = PackedBatch.from_lengths([2, 4, 1])
    p = PackedBatch.from_position_ids(ref.position_ids)
    assert p.lengths == ref.lengths and torch.equal(p.cu_seqlens, ref.cu_seqlens)
    for lengths in ([2, 4, 1], [3, 0, 2], [0, 5], [1]):
        ref = PackedBatch.from_lengths(lengths)
        p = PackedBatch.from_cu_seqlens(ref.cu_seqlens, total_tokens=sum(lengths), max_seqlen=9)
        assert p.lengths is None and p.max_seqlen == 9  # nothing read: a bound stands in for the longest
        for name in ("cu_seqlens", "position_ids", "seq_ids"):
            assert torch.equal(getattr(p, name), getattr(ref, name)), name
        assert p.host_lengths() == ref.lengths and p.max_seqlen == max(lengths)  # read on demand


def test_from_attention_mask_matches_from_lengths_and_keeps_the_padded_order():
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]])
    p = PackedBatch.from_attention_mask(mask)
    ref = PackedBatch.from_lengths([3, 0, 2])
    assert p.lengths == ref.lengths and p.max_seqlen == 3 and p.padded_shape == (3, 4)
    for name in ("cu_seqlens", "position_ids", "seq_ids"):
        assert torch.equal(getattr(p, name), getattr(ref, name)), name
    assert p.indices.tolist() == [1, 2, 3, 8, 9]


def test_from_sequences_concatenates_into_one_row():
    flat, p = PackedBatch.from_sequences([torch.tensor([1, 2]), torch.tensor([3])])
    assert flat.tolist() == [[1, 2, 3]] and p.lengths == (2, 1)


def test_bad_metadata_is_rejected():
    with pytest.raises(ValueError, match="at least one token"):
        PackedBatch.from_lengths([0, 0])
    with pytest.raises(ValueError, match="int32"):
        PackedBatch(lengths=(2,), cu_seqlens=torch.tensor([0, 2]), position_ids=torch.zeros(1, 2), seq_ids=torch.zeros(2))


def test_collator_flattens_and_masks_every_sequence_start():
    batch = FlattenCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 9]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == 3 and isinstance(batch["max_length_k"], int)


def test_collator_keeps_an_empty_sample_as_an_empty_slot():
    batch = FlattenCollator()([{"input_ids": [1, 2]}, {"input_ids": []}, {"input_ids": [3]}])
    assert batch["cu_seq_lens_q"].tolist() == [0, 2, 2, 3]
    with pytest.raises(ValueError, match="every sample"):
        FlattenCollator()([{"input_ids": []}])


def test_collator_truncates_overlong_samples_with_a_warning_or_refuses():
    with pytest.warns(UserWarning, match="sample 1 has 5 tokens; truncated to max_length=3"):
        batch = FlattenCollator(CollatorConfig(max_length=3))([{"input_ids": [1]}, {"input_ids": [1, 2, 3, 4, 5]}])
    assert batch["input_ids"].tolist() == [[1, 1, 2, 3]]
    with pytest.raises(ValueError, match="over max_length"):
        FlattenCollator(CollatorConfig(max_length=3, overlong="error"))([{"input_ids": [1, 2, 3, 4]}])


def test_collator_keeps_labels_that_are_all_ignored():
    batch = FlattenCollator()([{"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}, {"input_ids": [4, 5]}])
    assert batch["labels"].tolist() == [[-100, -100, -100, -100, 5]]


def test_collator_rounds_the_packed_length_up_with_a_separate_filler_sequence():
    batch = FlattenCollator(CollatorConfig(pad_to_multiple_of=8, pad_token_id=0))([{"input_ids": [1, 2, 3]}])
    assert batch["input_ids"].shape == (1, 8)
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 8]
    assert batch["labels"][0, 3:].tolist() == [-100] * 5


def test_collator_config_rejects_bad_settings():
    with pytest.raises(ValueError, match="overlong"):
        CollatorConfig(overlong="drop")
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        CollatorConfig(pad_to_multiple_of=0)


def test_collator_rejects_mismatched_labels():
    with pytest.raises(ValueError, match="sample 0: 2 input_ids but 1 labels"):
        FlattenCollator()([{"input_ids": [1, 2], "labels": [1]}])


def test_best_fit_decreasing_respects_the_budget_and_places_every_sample_once():
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(300)]
    bins = best_fit_decreasing(lengths, 256)
    assert sorted(i for b in bins for i in b) == list(range(300))
    assert all(sum(lengths[i] for i in b) <= 256 for b in bins)
    lower_bound = -(-sum(lengths) // 256)
    assert len(bins) <= lower_bound + 2  # BFD is near-optimal on many small items
    assert bins == best_fit_decreasing(lengths, 256)


def test_best_fit_decreasing_refuses_a_sample_over_the_budget():
    with pytest.raises(ValueError, match="sample 1 has 9 tokens"):
        best_fit_decreasing([3, 9], 8)


def test_best_fit_decreasing_batches_work_as_a_dataloader_batch_sampler():
    data = [{"input_ids": list(range(1, n + 1))} for n in (5, 3, 7, 1)]
    bins = best_fit_decreasing([5, 3, 7, 1], 8)
    loader = torch.utils.data.DataLoader(data, batch_sampler=bins, collate_fn=FlattenCollator())
    assert [b["input_ids"].shape[1] for b in loader] == [8, 8]


def test_core_compile_imports_without_transformers():
    import subprocess
    import sys

    code = "import sys, slipstream.core_compile; assert 'transformers' not in sys.modules, 'imported transformers'"
    subprocess.run([sys.executable, "-c", code], check=True)
