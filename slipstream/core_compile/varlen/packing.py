"""Metadata of a packed (padding-free) batch: ``n`` sequences back to back in one row of
``total_tokens`` tokens, and what the model pass needs to treat them as independent."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["PackedBatch"]


@dataclass(kw_only=True, eq=False)
class PackedBatch:
    """Boundaries of the sequences in a packed row; build it with one of the ``from_*`` helpers."""

    lengths: tuple[int, ...]
    """Host copy of each sequence's length, so the model never syncs (zero allowed: an empty sample keeps its slot)."""
    cu_seqlens: torch.Tensor
    """``(n+1,)`` int32 cumulative lengths, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == total_tokens``."""
    position_ids: torch.Tensor
    """``(1, total_tokens)`` int64 position of each token inside its own sequence (rotary)."""
    seq_ids: torch.Tensor
    """``(total_tokens,)`` int32 index of the sequence each token belongs to (document masks)."""
    indices: torch.Tensor | None = None
    """``(total_tokens,)`` int64 flat index into ``padded_shape`` of each token, or ``None``."""
    padded_shape: tuple[int, int] | None = None
    """``(batch, seq_len)`` of the padded layout the batch came from, or ``None``."""
    max_seqlen: int = field(init=False)
    """Longest sequence (Python int, computed on the host: no device sync in the model)."""

    def __post_init__(self) -> None:
        if not self.lengths:
            raise ValueError("a packed batch needs at least one sequence")
        if any(int(n) < 0 for n in self.lengths):
            raise ValueError(f"sequence lengths must be >= 0, got {self.lengths}")
        self.lengths = tuple(int(n) for n in self.lengths)
        if self.total_tokens == 0:
            raise ValueError("a packed batch needs at least one token; every sequence is empty")
        if self.cu_seqlens.dtype != torch.int32 or self.cu_seqlens.shape != (len(self.lengths) + 1,):
            raise ValueError(f"cu_seqlens must be int32 of shape ({len(self.lengths) + 1},), got "
                             f"{self.cu_seqlens.dtype} {tuple(self.cu_seqlens.shape)}")
        if self.position_ids.shape != (1, self.total_tokens):
            raise ValueError(f"position_ids must be (1, {self.total_tokens}), got {tuple(self.position_ids.shape)}")
        if (self.indices is None) != (self.padded_shape is None):
            raise ValueError("indices and padded_shape come together (both or neither)")
        self.max_seqlen = max(self.lengths)

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], *, device: torch.device | str | None = None) -> "PackedBatch":
        """Metadata for sequences of ``lengths`` laid out back to back (no host sync)."""
        lengths = tuple(int(n) for n in lengths)
        lens = torch.tensor(lengths, dtype=torch.int64)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=cu[1:])
        seq_ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lens)
        starts = torch.repeat_interleave(cu[:-1].long(), lens)
        positions = (torch.arange(int(lens.sum())) - starts).unsqueeze(0)
        return cls(lengths=lengths, cu_seqlens=cu.to(device), position_ids=positions.to(device),
                   seq_ids=seq_ids.to(device))

    @classmethod
    def from_sequences(cls, sequences: Sequence[torch.Tensor], *,
                       device: torch.device | str | None = None) -> tuple[torch.Tensor, "PackedBatch"]:
        """Concatenate 1-D token tensors into ``(1, total_tokens)`` and describe the result."""
        flat = torch.cat([torch.as_tensor(s).reshape(-1) for s in sequences]).unsqueeze(0)
        return flat.to(device), cls.from_lengths([len(s) for s in sequences], device=device)

    @classmethod
    def from_attention_mask(cls, attention_mask: torch.Tensor) -> "PackedBatch":
        """Metadata for the real tokens of a padded batch (any padding side).

        ``attention_mask``: ``(batch, seq_len)``, nonzero at real tokens, each row's real tokens
        contiguous. Host sync: reads the per-row counts once.
        """
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be (batch, seq_len), got {tuple(attention_mask.shape)}")
        mask = attention_mask.bool()
        lengths = mask.sum(1).tolist()  # host sync, once per batch
        flat = mask.reshape(-1)
        indices = torch.nonzero(flat, as_tuple=False).reshape(-1)
        # Holes inside a row (1 0 1) would make real tokens attend across a gap the padded
        # model does not see: refuse rather than silently change the math.
        runs = mask[:, :1].int() + (mask[:, 1:] & ~mask[:, :-1]).int().sum(1, keepdim=True)
        if bool((runs > 1).any()):
            raise ValueError("attention_mask has gaps inside a row; each row's real tokens must be contiguous")
        packed = cls.from_lengths(lengths, device=mask.device)
        packed.indices = indices
        packed.padded_shape = (mask.shape[0], mask.shape[1])
        return packed

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor) -> "PackedBatch":
        """Metadata from ``(n+1,)`` offsets. Host sync when ``cu_seqlens`` is on a GPU."""
        cu = cu_seqlens.reshape(-1).tolist()
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        return cls.from_lengths(lengths, device=cu_seqlens.device)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> "PackedBatch":
        """Metadata from a flattened row whose positions restart at 0 for each sequence.

        ``position_ids``: ``(1, total_tokens)``. Host sync: reads the restart points once.
        """
        if position_ids.dim() != 2 or position_ids.shape[0] != 1:
            raise ValueError(f"packed position_ids must be (1, total_tokens), got {tuple(position_ids.shape)}")
        row = position_ids[0]
        starts = torch.nonzero(row == 0, as_tuple=False).reshape(-1).tolist()  # host sync
        if not starts or starts[0] != 0:
            raise ValueError("packed position_ids must start at 0")
        bounds = starts + [row.numel()]
        packed = cls.from_lengths([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=row.device)
        if not torch.equal(packed.position_ids, position_ids.to(packed.position_ids.dtype)):
            raise ValueError("packed position_ids must count 0, 1, 2, ... within each sequence")
        return packed

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Host copy of ``cu_seqlens``: ``(n+1,)`` Python ints."""
        return (0, *itertools.accumulate(self.lengths))

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> "PackedBatch":
        """The same metadata with its tensors on ``device`` (lengths stay on the host)."""
        moved = {name: getattr(self, name).to(device, non_blocking=non_blocking)
                 for name in ("cu_seqlens", "position_ids", "seq_ids")}
        indices = None if self.indices is None else self.indices.to(device, non_blocking=non_blocking)
        return PackedBatch(lengths=self.lengths, indices=indices, padded_shape=self.padded_shape, **moved)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """``(batch, seq_len, *rest)`` -> ``(1, total_tokens, *rest)``: keep the real tokens."""
        if self.indices is None:
            raise ValueError("this packed batch was not built from a padded layout")
        return padded.reshape(-1, *padded.shape[2:]).index_select(0, self.indices).unsqueeze(0)

    def pad(self, packed: torch.Tensor, value: float = 0.0) -> torch.Tensor:
        """``(1, total_tokens, *rest)`` -> ``(batch, seq_len, *rest)``, ``value`` at padding."""
        if self.indices is None:
            raise ValueError("this packed batch was not built from a padded layout")
        rows = packed.reshape(-1, *packed.shape[2:])
        out = rows.new_full((self.padded_shape[0] * self.padded_shape[1], *rows.shape[1:]), value)
        out = out.index_copy(0, self.indices, rows)
        return out.reshape(*self.padded_shape, *rows.shape[1:])
