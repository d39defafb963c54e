"""Intra-node and inter-node subgroups of a process group, one set per communicator.

Subgroups are gloo groups (the shared-memory set-up and the inter-node transport move CPU
tensors, whatever the parent group's backend: gloo, NCCL, or slipstream's own) created with
``use_local_synchronization=True``, so only their members take part: a data-parallel group
inside a bigger world builds its own without the other ranks. Every rank creates its
intra-node group first, then its inter-node group, so a group's members all create it at the
same point of that order, which cannot deadlock.

Each communicator owns its subgroups. Sharing them between communicators of the same ranks
was wrong: each communicator runs asynchronous calls on its own thread, and two threads
driving one gloo group can order their calls differently on different ranks (a hang seen in
the backend's 2-node tests). torch names such groups by their ranks and its count of groups,
so a second group of the same ranks gets a name of its own.
"""

from __future__ import annotations

import torch.distributed as dist

from .topology import Topology

__all__ = ["group_ranks", "new_gloo_group", "node_subgroups"]

SUBGROUP_BACKEND = "gloo"


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` in group-rank order."""
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def node_subgroups(
    group: dist.ProcessGroup | None, topo: Topology
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """``(intra, inter)`` for this rank: a gloo group of its node's ranks (None when it is
    alone on its node) and a gloo group of its peers of the same local index on the other
    nodes (None on one node). Collective over ``group``; needs equal nodes."""
    ranks = group_ranks(group)
    intra = None
    if topo.local_size > 1:
        intra = new_gloo_group([ranks[g] for g in topo.local_ranks])
    inter = None
    if topo.num_nodes > 1:
        inter = new_gloo_group([ranks[g] for g in topo.peers(topo.local_rank)])
    return intra, inter


def new_gloo_group(ranks: list[int]) -> dist.ProcessGroup:
    """A new gloo group of ``ranks`` (global); collective over those ranks only."""
    return dist.new_group(sorted(ranks), backend=SUBGROUP_BACKEND, use_local_synchronization=True)
