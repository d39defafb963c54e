"""Metadata of a packed (padding-free) batch: ``n`` sequences back to back in one row of
``total_tokens`` tokens, and what the model pass needs to treat them as independent."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["PackedBatch"]


@dataclass(kw_only=True, eq=False)
class PackedBatch:
    """Boundaries of the sequences in a packed row; build it with one of the ``from_*`` helpers.

    What a GPU job pays for it depends on where the lengths are known. From host lengths
    (``from_lengths``, :class:`~slipstream.core_compile.varlen.collator.FlattenCollator`) and from
    offsets already on the device (``from_cu_seqlens``) nothing is read back to the host; from a
    padded ``attention_mask``, the per-row counts are read once. Built on the device,
    ``lengths`` stays ``None`` until :meth:`host_lengths` reads them (the per-sequence ``sdpa``
    attention needs them; the one-call kernels do not).
    """

    cu_seqlens: torch.Tensor
    """``(n+1,)`` int32 cumulative lengths, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == total_tokens``."""
    position_ids: torch.Tensor
    """``(1, total_tokens)`` int64 position of each token inside its own sequence (rotary)."""
    seq_ids: torch.Tensor
    """``(total_tokens,)`` int32 index of the sequence each token belongs to (document masks)."""
    lengths: tuple[int, ...] | None = None
    """Host copy of each sequence's length (zero allowed: an empty sample keeps its slot), or
    ``None`` where the batch was described on its device without reading it back."""
    max_seqlen: int | None = None
    """Longest sequence, a Python int: exact where ``lengths`` are known, else the bound given
    (the collator's ``max_length_q``, the padded width) or ``total_tokens``. Flash kernels take
    an upper bound: it sizes their grid, not their result."""
    indices: torch.Tensor | None = None
    """``(total_tokens,)`` int64 flat index into ``padded_shape`` of each token, or ``None``."""
    padded_shape: tuple[int, int] | None = None
    """``(batch, seq_len)`` of the padded layout the batch came from, or ``None``."""

    def __post_init__(self) -> None:
        if self.cu_seqlens.dtype != torch.int32 or self.cu_seqlens.dim() != 1 or len(self.cu_seqlens) < 2:
            raise ValueError(f"cu_seqlens must be int32 of shape (n+1,) with n >= 1, got {self.cu_seqlens.dtype} "
                             f"{tuple(self.cu_seqlens.shape)}")
        if self.position_ids.dim() != 2 or self.position_ids.shape[0] != 1:
            raise ValueError(f"position_ids must be (1, total_tokens), got {tuple(self.position_ids.shape)}")
        if self.total_tokens == 0:
            raise ValueError("a packed batch needs at least one token; every sequence is empty")
        if self.lengths is not None:
            self.lengths = tuple(int(n) for n in self.lengths)
            if len(self.lengths) + 1 != len(self.cu_seqlens) or sum(self.lengths) != self.total_tokens:
                raise ValueError(f"lengths {self.lengths} do not match cu_seqlens of shape "
                                 f"{tuple(self.cu_seqlens.shape)} and {self.total_tokens} tokens")
            if any(n < 0 for n in self.lengths):
                raise ValueError(f"sequence lengths must be >= 0, got {self.lengths}")
            self.max_seqlen = max(self.lengths)
        elif self.max_seqlen is None:
            self.max_seqlen = self.total_tokens
        if (self.indices is None) != (self.padded_shape is None):
            raise ValueError("indices and padded_shape come together (both or neither)")

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], *, device: torch.device | str | None = None) -> "PackedBatch":
        """Metadata for sequences of ``lengths`` laid out back to back, built on the host and
        copied to ``device`` (no host sync)."""
        lengths = tuple(int(n) for n in lengths)
        if not lengths:
            raise ValueError("a packed batch needs at least one sequence")
        if any(n < 0 for n in lengths):
            raise ValueError(f"sequence lengths must be >= 0, got {lengths}")
        lens = torch.tensor(lengths, dtype=torch.int64)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=cu[1:])
        seq_ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lens)
        starts = torch.repeat_interleave(cu[:-1].long(), lens)
        positions = (torch.arange(sum(lengths)) - starts).unsqueeze(0)
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
        """Metadata for the real tokens of a padded batch (any padding side), built on the mask's device.

        ``attention_mask``: ``(batch, seq_len)``, nonzero at real tokens, each row's real tokens
        contiguous. Host sync: one read of ``batch + 1`` ints, the per-row counts and whether
        any row has a gap; the packed row's length is the shape everything after it takes.
        """
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be (batch, seq_len), got {tuple(attention_mask.shape)}")
        mask = attention_mask.bool()
        counts = mask.sum(1)
        # Holes inside a row (1 0 1) would make real tokens attend across a gap the padded
        # model does not see: refuse rather than silently change the math.
        runs = mask[:, :1].long() + (mask[:, 1:] & ~mask[:, :-1]).long().sum(1, keepdim=True)
        *lengths, gaps = torch.cat([counts, (runs > 1).any().reshape(1).long()]).tolist()  # the host sync
        if gaps:
            raise ValueError("attention_mask has gaps inside a row; each row's real tokens must be contiguous")
        total = sum(lengths)
        if total == 0:
            raise ValueError("a packed batch needs at least one token; every sequence is empty")
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=mask.device)
        torch.cumsum(counts, 0, out=cu[1:])
        seq_ids, positions = _token_layout(cu, total)
        indices = torch.nonzero_static(mask.reshape(-1), size=total).reshape(-1)  # its size is known: no sync
        return cls(lengths=lengths, cu_seqlens=cu, position_ids=positions, seq_ids=seq_ids, indices=indices,
                   padded_shape=(mask.shape[0], mask.shape[1]))

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, *, total_tokens: int,
                        max_seqlen: int | None = None) -> "PackedBatch":
        """Metadata from ``(n+1,)`` offsets, built on their device without reading them (no host
        sync). ``total_tokens``: the packed row's length (the tokens' shape); ``max_seqlen``: the
        longest sequence or a bound on it (default ``total_tokens``). The offsets are trusted:
        checking them against ``total_tokens`` would read them; :meth:`host_lengths` does."""
        cu = cu_seqlens.reshape(-1).to(torch.int32)
        seq_ids, positions = _token_layout(cu, total_tokens)
        return cls(cu_seqlens=cu, position_ids=positions, seq_ids=seq_ids, max_seqlen=max_seqlen)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> "PackedBatch":
        """Metadata from a flattened row whose positions restart at 0 for each sequence.

        ``position_ids``: ``(1, total_tokens)``. Host syncs: reads the restart points, and
        checks the positions count up inside each sequence.
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
        """Tokens in the row, from ``position_ids``' shape (no sync; symbolic when traced)."""
        return self.position_ids.shape[1]

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    def host_lengths(self) -> tuple[int, ...]:
        """Each sequence's length as Python ints. Host sync where the batch was built on its
        device (``from_cu_seqlens``): the offsets are read once, then kept."""
        if self.lengths is None:
            cu = self.cu_seqlens.tolist()  # host sync, once per batch
            lengths = tuple(b - a for a, b in zip(cu[:-1], cu[1:]))
            if cu[0] != 0 or any(n < 0 for n in lengths):
                raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {cu}")
            self.lengths, self.max_seqlen = lengths, max(lengths)
        return self.lengths

    @property
    def offsets(self) -> tuple[int, ...]:
        """Host copy of ``cu_seqlens``: ``(n+1,)`` Python ints (see :meth:`host_lengths`)."""
        return (0, *itertools.accumulate(self.host_lengths()))

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> "PackedBatch":
        """The same metadata with its tensors on ``device`` (lengths stay on the host). The
        signature of ``Tensor.to``: accelerate's ``send_to_device`` moves a batch's
        ``PackedBatch`` with it, ``non_blocking`` as it moves the tensors. A non-blocking copy to
        CUDA from pageable memory is pinned first: from pageable memory the driver may make the
        host wait for the stream before it copies (CUDA's "API synchronization behavior")."""
        device = torch.device(device)

        def move(t: torch.Tensor) -> torch.Tensor:
            if non_blocking and device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
                t = t.pin_memory()
            return t.to(device, non_blocking=non_blocking)

        return self._map(move)

    def pin_memory(self) -> "PackedBatch":
        """The same metadata in pinned host memory: what a ``DataLoader(pin_memory=True)``
        calls on the batch, so that :meth:`to` copies it without blocking."""
        return self._map(lambda t: t.pin_memory())

    def _map(self, fn) -> "PackedBatch":
        tensors = {name: fn(getattr(self, name)) for name in ("cu_seqlens", "position_ids", "seq_ids")}
        indices = None if self.indices is None else fn(self.indices)
        return PackedBatch(lengths=self.lengths, max_seqlen=self.max_seqlen, indices=indices,
                           padded_shape=self.padded_shape, **tensors)

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


def _token_layout(cu: torch.Tensor, total_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``seq_ids`` ``(total_tokens,)`` int32 and ``position_ids`` ``(1, total_tokens)`` int64 of
    the row ``cu`` (``(n+1,)`` int32) describes, computed on ``cu``'s device without reading it:
    token ``t`` belongs to the last sequence starting at or before it (an empty sequence starts
    where the next one does, so holds none)."""
    starts = cu.long()
    tokens = torch.arange(total_tokens, device=cu.device)
    seq_ids = torch.searchsorted(starts[1:], tokens, right=True)
    positions = (tokens - starts[seq_ids]).unsqueeze(0)
    return seq_ids.to(torch.int32), positions
