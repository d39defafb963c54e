"""Intra-node and inter-node subgroups of a process group, built once and cached.

Subgroups are created with ``use_local_synchronization=True``, so only their members take
part: a data-parallel group inside a bigger world can build its own without the other
ranks. Every rank creates its intra-node group first, then its inter-node group; a group's
members therefore all create it at the same point of that order, which cannot deadlock.
Such groups are named by a hash of their ranks, so creating the same ranks twice would
collide: the cache returns the one already made.
"""

from __future__ import annotations

import torch.distributed as dist

from .topology import Topology

__all__ = ["group_ranks", "node_subgroups"]

# (backend, global ranks) -> group. Entries die with the default group (checked on use).
_CACHE: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup] = {}


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` in group-rank order."""
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def _subgroup(ranks: tuple[int, ...], backend: str) -> dist.ProcessGroup:
    ranks = tuple(sorted(ranks))  # new_group orders members by global rank
    key = (backend, ranks)
    cached = _CACHE.get(key)
    if cached is not None and cached in dist.distributed_c10d._world.pg_map:
        return cached
    pg = dist.new_group(list(ranks), backend=backend, use_local_synchronization=True)
    _CACHE[key] = pg
    return pg


def node_subgroups(
    group: dist.ProcessGroup | None, topo: Topology
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """``(intra, inter)`` for this rank: the group of its node's ranks (None when it is alone
    on its node; ``group`` itself when the group is one node) and the group of its peers of
    the same local index on the other nodes (None on one node; ``group`` itself when every
    node holds one rank). Collective over ``group``."""
    group = group if group is not None else dist.group.WORLD
    ranks = group_ranks(group)
    backend = str(dist.get_backend(group))
    intra_ranks = tuple(ranks[g] for g in topo.local_ranks)
    if topo.num_nodes == 1:
        intra = group if len(ranks) > 1 else None
    elif len(intra_ranks) == 1:
        intra = None
    else:
        intra = _subgroup(intra_ranks, backend)
    if topo.num_nodes == 1:
        inter = None
    elif topo.local_size == 1:
        inter = group
    else:
        inter = _subgroup(tuple(ranks[g] for g in topo.peers(topo.local_rank)), backend)
    return intra, inter
