"""Token-balanced micro-batches: determinism, balance, same samples per step (pure logic)."""

from __future__ import annotations

import random

import pytest

from slipstream.core_compile import TokenBalancedBatchSampler, balance


def _lengths(n=200, seed=0):
    rng = random.Random(seed)
    return [rng.randint(5, 500) for _ in range(n)]


def _all_ranks(lengths, world, gas, **kw):
    return [
        list(TokenBalancedBatchSampler(lengths, world_size=world, rank=r, grad_accum_steps=gas, **kw))
        for r in range(world)
    ]


def test_same_seed_same_batches_and_epoch_changes_them():
    lengths = _lengths()
    a = TokenBalancedBatchSampler(lengths, global_batch_size=16, world_size=2, rank=1, seed=3)
    b = TokenBalancedBatchSampler(lengths, global_batch_size=16, world_size=2, rank=1, seed=3)
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b)


def test_each_step_holds_exactly_the_unbalanced_runs_samples():
    lengths, world, gas, g = _lengths(), 4, 2, 32
    ranks = _all_ranks(lengths, world, gas, global_batch_size=g, seed=7)
    sampler = TokenBalancedBatchSampler(lengths, global_batch_size=g, world_size=world, grad_accum_steps=gas, seed=7)
    for step in range(sampler.num_steps):
        got = sorted(i for r in range(world) for m in range(gas) for i in ranks[r][step * gas + m])
        assert got == sorted(sampler.step_samples(step))
    assert all(len(r) == sampler.num_steps * gas for r in ranks)


def test_ranks_get_near_equal_tokens_per_micro_step():
    lengths, world, gas = _lengths(400, seed=1), 4, 1
    ranks = _all_ranks(lengths, world, gas, global_batch_size=32, seed=0)
    for step in range(len(ranks[0])):
        loads = [sum(lengths[i] for i in ranks[r][step]) for r in range(world)]
        biggest = max(lengths[i] for r in range(world) for i in ranks[r][step])
        assert max(loads) - min(loads) <= biggest  # LPT bound
    # and much better than cutting the step into equal sample counts
    sampler = TokenBalancedBatchSampler(lengths, global_batch_size=32, world_size=world, seed=0)
    naive = [sampler.step_samples(s)[r::world] for s in range(sampler.num_steps) for r in range(world)]
    spread = lambda groups: max(sum(lengths[i] for i in g) for g in groups) - min(sum(lengths[i] for i in g) for g in groups)
    ours = [ranks[r][s] for s in range(sampler.num_steps) for r in range(world)]
    assert sum(spread(ours[k : k + world]) for k in range(0, len(ours), world)) < 0.25 * sum(
        spread(naive[k : k + world]) for k in range(0, len(naive), world)
    )


def test_every_micro_batch_has_a_sample():
    groups = balance([1000, 1, 1, 1], [0, 1, 2, 3], 4)
    assert all(groups) and sorted(i for g in groups for i in g) == [0, 1, 2, 3]


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="rank"):
        TokenBalancedBatchSampler([1] * 8, global_batch_size=4, world_size=2, rank=2)
    with pytest.raises(ValueError, match="cannot give one sample"):
        TokenBalancedBatchSampler([1] * 8, global_batch_size=3, world_size=2, grad_accum_steps=2)
