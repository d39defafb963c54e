"""Collate a batch of samples into one padding-free row.

:class:`FlattenCollator` is a plain ``collate_fn``: it works with any torch ``DataLoader``, the
Hugging Face ``Trainer`` (``data_collator=``) and TRL. It flattens *this* batch (the samples
per optimizer step and the number of steps do not change; nothing is repacked across
batches) and sets label ``-100`` at every sequence start, so no token learns to predict the
first token of the next sequence. The keys it returns are the ones transformers' own
flash-attention path reads (``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``), so a
batch means the same thing to the stock model under flash-attention and to the varlen pass, plus
``packed``, the same boundaries with their lengths on the host, which the stock model ignores.
:func:`best_fit_decreasing` is the separate repacking mode (a ``batch_sampler``).
"""

from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from .loss import IGNORE_INDEX
from .packing import PackedBatch

__all__ = ["CollatorConfig", "FlattenCollator", "best_fit_decreasing"]


@dataclass(kw_only=True, frozen=True)
class CollatorConfig:
    """How samples become one packed row."""

    max_length: int | None = None
    """Longest sample kept, in tokens; ``None``: no limit."""
    overlong: str = "truncate"
    """A sample over ``max_length``: ``"truncate"`` it (with a warning) or ``"error"``."""
    pad_to_multiple_of: int | None = None
    """Round the packed length up to a multiple of this (e.g. 64) so compiled graphs see few
    shapes. The filler is its own sequence of ``pad_token_id`` with label ``-100``: it attends
    only to itself and adds nothing to the loss."""
    pad_token_id: int = 0
    """Token id of the filler."""

    def __post_init__(self) -> None:
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be >= 1 or None, got {self.max_length}")
        if self.overlong not in ("truncate", "error"):
            raise ValueError(f"overlong must be 'truncate' or 'error', got {self.overlong!r}")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1 or None, got {self.pad_to_multiple_of}")


class FlattenCollator:
    """``collate_fn`` turning ``[{"input_ids": ..., "labels": ...}, ...]`` into one packed row.

    ``labels`` default to ``input_ids``. Returns a dict of
    ``input_ids``, ``labels``, ``position_ids``: ``(1, total)`` int64;
    ``cu_seq_lens_q`` = ``cu_seq_lens_k``: ``(n+1,)`` int32 (``n`` samples, plus one for the
    filler when ``pad_to_multiple_of`` adds any); ``max_length_q`` = ``max_length_k``: Python
    int; ``packed``: a :class:`~slipstream.core_compile.varlen.packing.PackedBatch` of the row,
    its lengths Python ints.

    The lengths are known here, on the host; ``packed`` carries them past the step's copy to the
    device, which moves only tensors (the Hugging Face ``Trainer``) or calls ``packed.to(device,
    non_blocking=...)`` (accelerate), so the varlen pass never reads them back from a GPU. A
    ``DataLoader(pin_memory=True)`` pins it (``PackedBatch.pin_memory``), and the pass copies it
    without blocking.
    """

    def __init__(self, config: CollatorConfig | None = None) -> None:
        self.config = config or CollatorConfig()

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not features:
            raise ValueError("cannot collate an empty batch")
        ids, labels = map(list, zip(*(self._sample(i, feature) for i, feature in enumerate(features))))
        lengths = [len(x) for x in ids]
        total = sum(lengths)
        multiple = self.config.pad_to_multiple_of
        filler = 0 if multiple is None else -total % multiple
        if total + filler == 0:
            raise ValueError("every sample in the batch is empty")
        if filler:
            ids.append(torch.full((filler,), self.config.pad_token_id, dtype=torch.long))
            labels.append(torch.full((filler,), IGNORE_INDEX, dtype=torch.long))
            lengths.append(filler)
        for y in labels:
            if len(y):
                y[0] = IGNORE_INDEX  # no target across the boundary
        packed = PackedBatch.from_lengths(lengths)
        return {
            "input_ids": torch.cat(ids).unsqueeze(0),
            "labels": torch.cat(labels).unsqueeze(0),
            "position_ids": packed.position_ids,
            "cu_seq_lens_q": packed.cu_seqlens,
            "cu_seq_lens_k": packed.cu_seqlens.clone(),
            "max_length_q": packed.max_seqlen,
            "max_length_k": packed.max_seqlen,
            "packed": packed,
        }

    def _sample(self, index: int, feature: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if "input_ids" not in feature:
            raise KeyError(f"sample {index} has no 'input_ids' (keys: {sorted(feature)})")
        x = torch.as_tensor(feature["input_ids"], dtype=torch.long).reshape(-1)
        y = feature.get("labels")
        y = x.clone() if y is None else torch.as_tensor(y, dtype=torch.long).reshape(-1).clone()
        if len(y) != len(x):
            raise ValueError(f"sample {index}: {len(x)} input_ids but {len(y)} labels")
        limit = self.config.max_length
        if limit is not None and len(x) > limit:
            if self.config.overlong == "error":
                raise ValueError(f"sample {index} has {len(x)} tokens, over max_length={limit}")
            warnings.warn(f"sample {index} has {len(x)} tokens; truncated to max_length={limit}", stacklevel=3)
            x, y = x[:limit], y[:limit]
        return x, y


def best_fit_decreasing(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sample indices into bins of at most ``token_budget`` tokens (best-fit decreasing), to
    hand to a ``DataLoader`` as ``batch_sampler``.

    Longest first, each sample goes to the open bin it fills most tightly, or a new bin. Bins
    are returned fullest first, indices ascending in each; deterministic. A sample longer than
    the budget raises.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    free: list[tuple[int, int]] = []  # (free tokens, bin id), sorted
    bins: list[list[int]] = []
    for i in order:
        n = lengths[i]
        if n > token_budget:
            raise ValueError(f"sample {i} has {n} tokens, over the token budget {token_budget}")
        slot = bisect.bisect_left(free, (n, -1))
        if slot == len(free):
            bins.append([i])
            bisect.insort(free, (token_budget - n, len(bins) - 1))
        else:
            room, b = free.pop(slot)
            bins[b].append(i)
            bisect.insort(free, (room - n, b))
    bins = [sorted(b) for b in bins]
    bins.sort(key=lambda b: (-sum(lengths[i] for i in b), b[0]))
    return bins
