"""Step-level loss normalisation: gradients independent of how tokens were split, on 1 and 2 ranks."""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks
from slipstream.core_compile import (
    FlattenCollator,
    GradReduction,
    TokenBalancedBatchSampler,
    apply_varlen,
    count_target_tokens,
    global_token_count,
    step_loss,
    sum_cross_entropy,
)
from slipstream.plugins.deepspeed.translate import grad_reduction as deepspeed_reduction
from slipstream.plugins.fsdp.translate import grad_reduction as fsdp_reduction
from slipstream.recipes.model import build_model

VOCAB = 61
LENGTHS = [17, 3, 29, 8, 1, 12, 22, 5]


def _samples():
    gen = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=gen)} for n in LENGTHS]


def _model():
    return apply_varlen(build_model("llama-tiny", vocab_size=VOCAB, seed=2))


def _reference_grads():
    """One padded-free pass over the whole step: sum over every token / every token."""
    model = _model()
    batch = FlattenCollator()(_samples())
    loss = sum_cross_entropy(model(**batch).logits, batch["labels"]) / count_target_tokens(batch["labels"])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _micro_step(model, samples, global_tokens, world, gas, reduction, loss_divisor=1):
    batch = FlattenCollator()(samples)
    loss_sum = sum_cross_entropy(model(**batch).logits, batch["labels"])
    loss = step_loss(loss_sum, global_tokens, dp_world_size=world, grad_accum_steps=gas, reduction=reduction)
    (loss / loss_divisor).backward()  # loss_divisor: what DeepSpeed's engine.backward does with scale_wrt_gas
    return loss_sum.detach()


def test_grad_accumulation_split_does_not_change_gradients():
    ref_loss, ref = _reference_grads()
    model = _model()
    samples = _samples()
    splits = [samples[:1], samples[1:6], samples[6:]]
    collate = FlattenCollator()
    tokens = global_token_count([collate(s)["labels"] for s in splits], group=None)
    total = sum(_micro_step(model, s, tokens, 1, 3, fsdp_reduction()) for s in splits)
    torch.testing.assert_close(total / tokens, ref_loss)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-6)


def test_step_with_no_target_token_gives_zero_not_nan():
    loss = step_loss(torch.tensor(0.0), torch.tensor(0), dp_world_size=2, grad_accum_steps=1, reduction=GradReduction())
    assert loss.item() == 0.0


def test_step_loss_rejects_bad_sizes():
    with pytest.raises(ValueError):
        step_loss(torch.tensor(1.0), 3, dp_world_size=0, grad_accum_steps=1, reduction=GradReduction())


def _two_rank_step(rank, world, deepspeed):
    import torch.distributed as dist

    gas = 2
    samples = _samples()
    sampler = TokenBalancedBatchSampler(
        [len(s["input_ids"]) for s in samples], global_batch_size=8, grad_accum_steps=gas, world_size=world, rank=rank
    )
    micro = [[samples[i] for i in idx] for idx in sampler]
    collate = FlattenCollator()
    tokens = global_token_count([collate(m)["labels"] for m in micro], group=dist.group.WORLD)
    reduction = deepspeed_reduction(scale_wrt_gas=True) if deepspeed else fsdp_reduction()
    model = _model()
    loss_sum = sum(_micro_step(model, m, tokens, world, gas, reduction, gas if deepspeed else 1) for m in micro)
    for p in model.parameters():  # the stack's averaging all-reduce (DDP / FSDP / DeepSpeed)
        dist.all_reduce(p.grad)
        p.grad /= world
    dist.all_reduce(loss_sum)
    ref_loss, ref = _reference_grads()
    torch.testing.assert_close(loss_sum / tokens, ref_loss)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-6)
    return int(tokens)


@pytest.mark.parametrize("deepspeed", [False, True], ids=["fsdp", "deepspeed_scale_wrt_gas"])
def test_two_ranks_with_grad_accumulation_match_the_single_pass(deepspeed):
    counts = run_ranks(_two_rank_step, 2, deepspeed, timeout=120)
    assert counts == [sum(n - 1 for n in LENGTHS)] * 2
