"""The tuner's plan: what a measured plan is valid for (``TuneKey``), its rows (``Entry``), the
lookup the communicator asks on every call (``TunedPlan``) and the bucket sizes derived from it
(``BucketSizes``). Public through ``slipstream.core_comm.tuner``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Mapping

import torch

from ..._common.cache import versions
from ..config import CommConfig
from ..ops import KINDS
from ..routing import Choice

FORMAT = 1  # bump when the cache layout or the meaning of an entry changes
_ALGORITHMS = ("stock", "shm", "hierarchical")


@dataclass(frozen=True, kw_only=True)
class TuneKey:
    """What a measured plan is valid for; a cached plan is used only under an equal key."""

    world_size: int
    node_sizes: tuple[int, ...]
    """Ranks per node, in node order."""
    paths: str
    """Fast path the communicator built: 'hierarchical', 'shm' or '' (none)."""
    torch: str
    slipstream: str
    format: int = FORMAT

    @classmethod
    def of(cls, comm) -> "TuneKey":
        """The key of a built ``Communicator``'s topology, with this process's versions."""
        paths = "hierarchical" if comm.hier is not None else "shm" if comm.shm is not None else ""
        v = versions()
        return cls(world_size=comm.world, node_sizes=tuple(comm.topology.node_sizes), paths=paths,
                   torch=v["torch"], slipstream=v["slipstream"])

    def to_json(self) -> dict:
        return {**asdict(self), "node_sizes": list(self.node_sizes)}

    def filename(self) -> str:
        """Named by the topology only: after an upgrade the old plan is found, reported stale
        (versions are checked inside) and replaced, instead of piling up."""
        return f"w{self.world_size}-n{'x'.join(map(str, self.node_sizes))}-{self.paths or 'stock'}.json"


@dataclass(frozen=True, kw_only=True)
class BucketSizes:
    """Bucket sizes for the training stacks, in bytes of the full buffer (allreduce's tensor,
    reduce-scatter's input, allgather's output): the smallest size whose measured bandwidth
    is within 80% of the best measured for that collective. Bigger buckets gain little
    bandwidth and start the first collective of a step later."""

    all_reduce_bytes: int = 16 << 20
    """DDP ``bucket_cap_mb``."""
    reduce_scatter_bytes: int = 16 << 20
    """ZeRO ``reduce_bucket_size`` (gradients are reduce-scattered to their owners)."""
    all_gather_bytes: int = 16 << 20
    """ZeRO ``allgather_bucket_size`` / ``stage3_prefetch_bucket_size``; FSDP wrap unit."""

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int of bytes, got {value!r}")

    def ddp_kwargs(self) -> dict:
        """Keyword arguments of ``DistributedDataParallel``."""
        return {"bucket_cap_mb": self.all_reduce_bytes / 2**20}


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One row of a plan: the choice for ``kind`` of ``nbytes`` of ``dtype``."""

    kind: str
    dtype: str | None
    """torch dtype name, or None for any dtype (the cost model)."""
    nbytes: int
    choice: Choice
    source: str
    """'measured' or 'model' (not measured: no budget left, or no cache)."""
    times_s: Mapping[str, float] = field(default_factory=dict)
    """Candidate label (``stock``, ``hierarchical/4M``) -> median time of the slowest rank."""
    default: str = ""
    """Label of the communicator's own choice for this call (its rules, no plan)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.choice.algorithm not in _ALGORITHMS:
            raise ValueError(f"bad entry: {self.kind} {self.choice}")
        if not isinstance(self.nbytes, int) or self.nbytes <= 0:
            raise ValueError(f"bad entry size {self.nbytes!r}")
        if self.choice.chunk_bytes is not None and (not isinstance(self.choice.chunk_bytes, int)
                                                    or self.choice.chunk_bytes <= 0):
            raise ValueError(f"bad chunk {self.choice.chunk_bytes!r}")


class TunedPlan:
    """Choices per (collective, dtype, size); a ``Plan`` for ``Communicator``. ``choose`` takes
    the entry nearest in log scale to the call's size rounded down to a power of two, of the
    call's dtype, or of the first dtype measured when the call's was not; None (the
    communicator's own rules) when the plan has no entry for the collective."""

    __slots__ = ("key", "entries", "connections", "connection_times_s", "buckets", "source", "_index")

    def __init__(self, *, key: TuneKey, entries: list[Entry], connections: int = 1,
                 connection_times_s: Mapping[str, float] | None = None,
                 buckets: BucketSizes | None = None, source: str = "model") -> None:
        if not 1 <= connections <= 16:
            raise ValueError(f"connections must be between 1 and 16, got {connections}")
        self.key = key
        self.entries = sorted(entries, key=lambda e: (KINDS.index(e.kind), str(e.dtype), e.nbytes))
        self.connections = connections                      # topology-wide: goes into CommConfig
        self.connection_times_s = dict(connection_times_s or {})  # count -> 8 MiB allreduce, if measured
        self.buckets = buckets if buckets is not None else BucketSizes()
        self.source = source                                # 'measured', 'cached' or 'model'
        # kind -> dtype (None: the first measured) -> choice by ``nbytes.bit_length()``: the
        # communicator asks on every call, so a lookup is two dict hits and an index.
        self._index: dict[str, dict] = {}
        points: dict = {}
        for e in self.entries:
            dtype = getattr(torch, e.dtype) if e.dtype else None
            points.setdefault(e.kind, {}).setdefault(dtype, []).append((math.log2(e.nbytes), e.choice))
        for kind, by_dtype in points.items():
            tables = {dtype: _by_bit_length(p) for dtype, p in by_dtype.items()}
            tables.setdefault(None, next(iter(tables.values())))  # dtypes not measured
            self._index[kind] = tables

    def choose(self, kind: str, nbytes: int, dtype: torch.dtype) -> Choice | None:
        tables = self._index.get(kind)
        if tables is None:
            return None
        table = tables.get(dtype) or tables[None]
        return table[min(nbytes.bit_length(), 64)]

    def apply(self, config: CommConfig) -> CommConfig:
        """``config`` with the plan's topology-wide settings (the connections it measured)."""
        if self.key.paths != "hierarchical" or config.connections == self.connections:
            return config
        return replace(config, connections=self.connections)

    def to_json(self) -> dict:
        return {"format": FORMAT, "key": self.key.to_json(), "connections": self.connections,
                "connection_times_s": self.connection_times_s,
                "buckets": asdict(self.buckets),
                "entries": [{**asdict(e), "choice": asdict(e.choice)} for e in self.entries]}

    @classmethod
    def from_json(cls, data: dict, *, source: str = "cached") -> "TunedPlan":
        """Raises KeyError / TypeError / ValueError on anything malformed."""
        key = TuneKey(**{**data["key"], "node_sizes": tuple(data["key"]["node_sizes"])})
        entries = [Entry(**{**e, "choice": Choice(**e["choice"])}) for e in data["entries"]]
        return cls(key=key, entries=entries, connections=int(data["connections"]),
                   connection_times_s={str(k): float(v) for k, v in data.get("connection_times_s", {}).items()},
                   buckets=BucketSizes(**data["buckets"]), source=source)

    def rows(self) -> list[dict]:
        """One dict per entry, for tables: the choice, its time and the default's."""
        out = []
        for e in self.entries:
            chosen = e.times_s.get(_label(e.choice))
            out.append(dict(kind=e.kind, dtype=e.dtype or "any", nbytes=e.nbytes, algorithm=e.choice.algorithm,
                            chunk_bytes=e.choice.chunk_bytes, source=e.source, default=e.default,
                            time_s=chosen, default_time_s=e.times_s.get(e.default), times_s=dict(e.times_s)))
        return out


def _by_bit_length(points: list[tuple[float, Choice]]) -> tuple[Choice, ...]:
    """For each bit length b (sizes 2^(b-1) .. 2^b - 1), the choice measured nearest to
    2^(b-1) in log scale (ties: the smaller size)."""
    points = sorted(points, key=lambda p: p[0])
    return tuple(min(points, key=lambda p: (abs(p[0] - max(b - 1, 0)), p[0]))[1] for b in range(65))


def _label(choice: Choice) -> str:
    if choice.chunk_bytes is None:
        return choice.algorithm
    c = choice.chunk_bytes
    return f"{choice.algorithm}/{c >> 20}M" if c % (1 << 20) == 0 else f"{choice.algorithm}/{c >> 10}K"
