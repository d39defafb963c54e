"""The tuner's cost model: the choices where nothing was measured, from measurements on the
benchmark machine (the thresholds' comments say which)."""

from __future__ import annotations

from ..config import CommConfig
from ..ops import KINDS
from ..routing import STOCK_BELOW_BYTES, Choice
from .plan import BucketSizes, Entry, TunedPlan, TuneKey

__all__ = ["SIZE_CLASSES", "model_plan"]

SIZE_CLASSES = tuple(4096 << 2 * i for i in range(8))
"""4 KiB .. 64 MiB in powers of 4: full buffers measured (allreduce's tensor, reduce-scatter's
input, allgather's output, as ``bench comm``). Entries are keyed by the bytes the communicator
passes to ``choose``: the same, except allgather's, which is one rank's input."""


def model_plan(key: TuneKey, config: CommConfig) -> TunedPlan:
    """The built-in choices where nothing was measured. See the thresholds' comments."""
    entries = [Entry(kind=kind, dtype=None, nbytes=n, choice=choice, source="model")
               for kind in KINDS for full in SIZE_CLASSES
               if (n := max(1, full // key.world_size) if kind == "all_gather" else full)
               and (choice := _model_choice(key, config, kind, n)) is not None]
    return TunedPlan(key=key, entries=entries, connections=config.connections,
                     buckets=_MODEL_BUCKETS.get(key.paths, BucketSizes()), source="model")


# From `chrt -f 10 slipstream tune --budget 60` on the machine of benchmarks/results/tuner_*.md
# (2-core KVM guest, load from other users; medians of the slowest rank):
# - 1 node x 4 ranks: shm beat stock at every size and collective, 4 KiB - 64 MiB (allreduce
#   0.66 vs 0.91 ms at 4 KiB, 69 vs 76 ms at 64 MiB; allgather 64 MiB 29 vs 114 ms).
# - 2 nodes x 2 ranks, 1 Gbit/s: stock below ``routing.STOCK_BELOW_BYTES`` (its comment has the
#   figures). Chunks of 1 and 16 MiB were within 7% of 4 MiB (64 MiB: 649 / 688 / 698 ms): the
#   default stays.
# Buckets, same runs: the smallest size within 80% of the best bandwidth (1 MiB floor): 1 node
# allreduce 4 MiB, reduce-scatter 16 MiB, allgather 4 MiB; across the 1 Gbit/s link every
# collective is link-bound from 1 MiB (allreduce 1 MiB 11.3 ms = 93 MB/s, 64 MiB 96 MB/s).
# Faster links saturate later: `slipstream tune` measures the real cluster.
_MODEL_BUCKETS = {
    "shm": BucketSizes(all_reduce_bytes=4 << 20, reduce_scatter_bytes=16 << 20, all_gather_bytes=4 << 20),
    "hierarchical": BucketSizes(all_reduce_bytes=1 << 20, reduce_scatter_bytes=1 << 20, all_gather_bytes=1 << 20),
}


def _model_choice(key: TuneKey, config: CommConfig, kind: str, nbytes: int) -> Choice | None:
    """``nbytes`` as the communicator passes it (allgather: one rank's input)."""
    if key.paths == "shm":
        return Choice("shm")
    if key.paths != "hierarchical":
        return None
    full = nbytes * (key.world_size if kind == "all_gather" else 1)
    if full < max(STOCK_BELOW_BYTES.get(kind, 0), config.min_hierarchical_bytes):
        return Choice("stock")
    return Choice("hierarchical", config.chunk_bytes if kind == "all_reduce" else None)
