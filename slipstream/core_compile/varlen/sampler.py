"""Micro-batches with about the same number of real tokens on every data-parallel rank.

With padding removed, a micro-batch costs roughly its real tokens, not its sample count; equal
sample counts leave the rank with the longest samples the slowest, and every other rank waits
at the next collective. :class:`TokenBalancedBatchSampler` keeps each optimizer step's samples
exactly those of the plain run (a seeded permutation cut into global batches) and only
changes which rank and micro-step gets which of them: longest-processing-time greedy over the
``world_size * grad_accum_steps`` micro-batches of the step, each holding at least one sample.
"""

from __future__ import annotations

import heapq
from typing import Iterator, Sequence

import torch
from torch.utils.data import Sampler

__all__ = ["TokenBalancedBatchSampler", "balance"]


def balance(lengths: Sequence[int], samples: Sequence[int], parts: int) -> list[list[int]]:
    """Split ``samples`` (indices into ``lengths``) into ``parts`` groups of near-equal tokens.

    Longest first, each to the group with the fewest tokens (ties: lowest group), every group
    non-empty. Deterministic; indices ascending within a group.
    """
    if len(samples) < parts:
        raise ValueError(f"cannot give each of {parts} micro-batches a sample with only {len(samples)} samples")
    order = sorted(samples, key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, 0, g) for g in range(parts)]  # (tokens, samples, group): empty groups first
    for i in order:
        tokens, count, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (tokens + lengths[i], count + 1, g))
    return [sorted(g) for g in groups]


class TokenBalancedBatchSampler(Sampler[list[int]]):
    """``batch_sampler`` yielding this rank's micro-batches, ``grad_accum_steps`` per step.

    ``lengths[i]``: tokens of sample ``i``. Step ``s`` uses the samples
    ``perm[s*G:(s+1)*G]`` (``G = global_batch_size``, ``perm`` a permutation seeded by
    ``seed + epoch``, identity without ``shuffle``), as an unbalanced run would; an incomplete
    last global batch is dropped. Micro-step ``m`` of rank ``r`` gets group ``m*world_size + r``
    of :func:`balance`, so each micro-step is balanced across ranks.
    """

    def __init__(self, lengths: Sequence[int], *, global_batch_size: int, grad_accum_steps: int = 1,
                 world_size: int = 1, rank: int = 0, seed: int = 0, shuffle: bool = True) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
        if global_batch_size < world_size * grad_accum_steps:
            raise ValueError(f"global_batch_size={global_batch_size} cannot give one sample to each of "
                             f"{world_size} ranks x {grad_accum_steps} micro-steps")
        if len(lengths) < global_batch_size:
            raise ValueError(f"{len(lengths)} samples are fewer than one global batch of {global_batch_size}")
        self.lengths = [int(n) for n in lengths]
        self.global_batch_size, self.grad_accum_steps = global_batch_size, grad_accum_steps
        self.world_size, self.rank, self.seed, self.shuffle = world_size, rank, seed, shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def num_steps(self) -> int:
        return len(self.lengths) // self.global_batch_size

    def __len__(self) -> int:
        return self.num_steps * self.grad_accum_steps

    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.lengths)))
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.lengths), generator=gen).tolist()

    def step_samples(self, step: int) -> list[int]:
        """The samples of optimizer step ``step``, over all ranks (the unbalanced run's)."""
        g = self.global_batch_size
        return self._permutation()[step * g : (step + 1) * g]

    def __iter__(self) -> Iterator[list[int]]:
        parts = self.world_size * self.grad_accum_steps
        perm, g = self._permutation(), self.global_batch_size
        for step in range(self.num_steps):
            groups = balance(self.lengths, perm[step * g : (step + 1) * g], parts)
            for m in range(self.grad_accum_steps):
                yield groups[m * self.world_size + self.rank]
