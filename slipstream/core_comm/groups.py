"""Intra-node and inter-node subgroups of a process group, one set per communicator.

Subgroups are gloo groups (the shared-memory set-up and the inter-node transport move CPU
tensors, whatever the parent's backend) created with ``use_local_synchronization=True``: only
their members take part, so a data-parallel group inside a bigger world builds its own without
the other ranks. Every rank creates its intra-node group first, then its inter-node group, so
a group's members all create it at the same point of that order, which cannot deadlock. Each
communicator owns its subgroups: communicators sharing them ran async calls on two threads
driving one gloo group, which ordered calls differently on different ranks (a hang seen in the
backend's 2-node tests).
"""

from __future__ import annotations

import hashlib
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .topology import Topology

__all__ = ["group_ranks", "new_gloo_group", "node_subgroups", "release_groups"]


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` in group-rank order."""
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def node_subgroups(
    group: dist.ProcessGroup | None, topo: Topology, timeout: timedelta | None = None
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """``(intra, inter)`` for this rank: a gloo group of its node's ranks (None when it is
    alone on its node) and a gloo group of its peers of the same local index on the other
    nodes (None on one node). Collective over ``group``; needs equal nodes.

    On one node, a gloo ``group`` is its own intra-node group (the same members; the
    shared-memory path calls it only while it is set up, collectively), not a second one: the
    caller releases only what is not ``group``. The inter-node group is always a group of its
    own: the hierarchical path drives it from the communicator's thread while a stock call may
    run on ``group`` from the caller's."""
    ranks = group_ranks(group)
    if topo.local_size > 1 and topo.num_nodes == 1 and _is_gloo(group):
        return (group if group is not None else dist.GroupMember.WORLD), None
    intra = new_gloo_group([ranks[g] for g in topo.local_ranks], timeout) if topo.local_size > 1 else None
    inter = new_gloo_group([ranks[g] for g in topo.peers(topo.local_rank)], timeout) if topo.num_nodes > 1 else None
    return intra, inter


def new_gloo_group(ranks: list[int], timeout: timedelta | None = None) -> dist.ProcessGroup:
    """A new gloo group of ``ranks`` (global); collective over those ranks only. ``timeout``
    bounds its creation and its calls (None: torch's default for gloo, 30 minutes): a member
    that never arrives makes the others raise after it, naming the group's ranks.

    torch names a locally synchronised group by its ranks and the number of groups alive in
    the process (``_hash_ranks_to_str``, torch 2.13), and the name is the prefix of its
    rendezvous keys in the store. Members need not hold as many groups (a member of more
    subgroups built more communicators), and a name must not come back once its group is
    destroyed (its keys stay in the store: the new group's members would connect to the old
    one's closed addresses). So on arrival each member says how many groups it holds; every
    member counts placeholders up to the largest, and beyond the count this set of ranks was
    last named with (every member made the same groups of these ranks, in the same order)."""
    names = c10d._world.pg_names
    ranks = sorted(ranks)
    alive = max(_arrive(ranks, timeout or c10d.default_pg_timeout, len(names)), _NAMED.get(tuple(ranks), -1) + 1)
    pads: list = []
    try:
        while len(names) < alive or _hashed_name(ranks, len(names)) in names.values():
            pads.append(object())
            names[pads[-1]] = ""
        _NAMED[tuple(ranks)] = len(names)
        return dist.new_group(ranks, backend="gloo", use_local_synchronization=True, timeout=timeout)
    except RuntimeError as e:  # torch's store-barrier timeout, or gloo's failed connection
        raise RuntimeError(f"slipstream: the gloo group of ranks {ranks} could not be formed within "
                           f"{timeout or 'the default timeout'}: a member did not arrive (it died, or "
                           f"called another collective): {e}") from e
    finally:
        for pad in pads:
            names.pop(pad, None)


def _is_gloo(group) -> bool:
    """Whether ``group`` (None: WORLD) is a plain gloo group."""
    try:
        return dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):
        return False


def release_groups(*groups: dist.ProcessGroup | None) -> None:
    """Destroy the subgroups a communicator made (``node_subgroups``), those still alive: a
    job that makes and destroys many groups must not keep their sockets and threads. Local;
    each member does it when the communicator closes."""
    for group in groups:
        if group is not None and group in c10d._world.pg_map:
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError):  # torch tore it down meanwhile
                pass


# How many groups of each set of ranks this process has asked for: every member asks for the
# same ones in the same order, so the count tells one creation's arrivals from another's.
_ASKED: dict[tuple, int] = {}
# The count of groups torch last named each set of ranks' group with (``new_gloo_group``).
_NAMED: dict[tuple, int] = {}


def _arrive(ranks: list[int], timeout: timedelta, alive: int) -> int:
    """Every member of a new group announces itself on the default store, with ``alive`` (the
    groups it holds), and waits, within ``timeout``, for the others; the largest ``alive``
    of the members. The error names the global ranks that did not come. (torch's own
    barrier counts arrivals, so it cannot say who is missing.)"""
    key = tuple(ranks)
    _ASKED[key] = n = _ASKED.get(key, 0) + 1
    tag = hashlib.sha1("_".join(map(str, ranks)).encode(), usedforsecurity=False).hexdigest()[:16]
    store = dist.PrefixStore(f"slipstream-arrive/{tag}/{n}/", c10d._get_default_store())
    store.set(str(dist.get_rank()), str(alive))
    try:
        store.wait([str(r) for r in ranks], timeout)
        return max(int(store.get(str(r))) for r in ranks)
    except Exception as e:  # noqa: BLE001 - the store's timeout, or its host is gone
        try:
            missing, why = [r for r in ranks if not store.check([str(r)])], ""
        except Exception:  # noqa: BLE001
            missing, why = "unknown", f" (the store is unreachable: {e})"
        raise RuntimeError(f"slipstream: global rank(s) {missing} did not arrive within {timeout} to form "
                           f"the gloo group of ranks {ranks} (dead, or calling another collective){why}") from None


def _hashed_name(ranks: list[int], alive: int) -> str:
    """The name torch 2.13 gives a locally synchronised group of ``ranks`` (sorted)."""
    text = "_".join(["_".join(map(str, ranks)), str(alive)])
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()
