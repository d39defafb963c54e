"""Which ranks of a process group share a node.

A rank's node comes from, in order of precedence: 1. ``SLIPSTREAM_NODE``, an explicit override
(set by the emulated-cluster launcher, or by a user whose nodes are not what the launcher says);
2. the launcher's node rank: ``GROUP_RANK`` (torchrun), ``CROSS_RANK`` (DeepSpeed's launcher),
``NODE_RANK`` (accelerate / lightning); 3. the host identity (host name and kernel boot id),
exchanged through the group. Every source is checked against the host identity: two ranks on
different hosts never share a node, whatever the environment claims, because shared memory
cannot span hosts.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch.distributed as dist

__all__ = ["Topology", "detect_topology", "node_key_from_env", "host_identity"]

OVERRIDE_VAR = "SLIPSTREAM_NODE"
_LAUNCHER_NODE_VARS = ("GROUP_RANK", "CROSS_RANK", "NODE_RANK")


@dataclass(frozen=True)
class Topology:
    """Placement of the ranks of one process group on nodes, numbered in order of their lowest
    group rank (so every rank computes the same numbering from the same gathered keys)."""

    node_of: tuple[int, ...]
    """Group rank -> node index (0 .. num_nodes-1)."""
    rank: int
    """This process's rank within the group."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < len(self.node_of):
            raise ValueError(f"rank {self.rank} outside a group of {len(self.node_of)}")
        seen = sorted(set(self.node_of))
        if seen != list(range(len(seen))):
            raise ValueError(f"node indices must be 0..n-1, got {seen}")

    @classmethod
    def from_keys(cls, keys: Sequence[object], rank: int) -> "Topology":
        """Build from one hashable node key per group rank."""
        index: dict[object, int] = {}
        return cls(tuple(index.setdefault(k, len(index)) for k in keys), rank)

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def num_nodes(self) -> int:
        return max(self.node_of) + 1

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    def ranks_on(self, node: int) -> tuple[int, ...]:
        """Group ranks on ``node``, ascending."""
        return tuple(r for r, n in enumerate(self.node_of) if n == node)

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self.ranks_on(self.node)

    @property
    def local_rank(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.local_ranks)

    @property
    def node_sizes(self) -> tuple[int, ...]:
        return tuple(len(self.ranks_on(n)) for n in range(self.num_nodes))

    @property
    def is_uniform(self) -> bool:
        """Every node holds the same number of ranks."""
        return len(set(self.node_sizes)) == 1

    @property
    def is_blocked(self) -> bool:
        """Ranks of each node are consecutive (node 0 holds ranks 0..m-1, and so on)."""
        return list(self.node_of) == sorted(self.node_of)

    def peers(self, local_rank: int) -> tuple[int, ...]:
        """Group ranks holding ``local_rank`` on each node (the inter-node group of that index)."""
        return tuple(self.ranks_on(n)[local_rank] for n in range(self.num_nodes))


def host_identity() -> str:
    """Host name plus kernel boot id: equal exactly for processes on the same machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def node_key_from_env(environ: Mapping[str, str] = os.environ) -> tuple[str, str] | None:
    """``(source, value)`` naming this rank's node from the environment, or None."""
    if environ.get(OVERRIDE_VAR):
        return ("override", environ[OVERRIDE_VAR])
    for var in _LAUNCHER_NODE_VARS:
        if environ.get(var):
            return ("launcher", environ[var])
    return None


def resolve_keys(entries: Sequence[tuple[tuple[str, str] | None, str]]) -> list[object]:
    """Pick one node key per rank from gathered ``(env_key, host)`` pairs; raise on conflicts.
    The environment is trusted only when every rank has a key from the same source; a mix
    falls back to host identity."""
    env_keys = [k for k, _ in entries]
    sources = {k[0] if k else None for k in env_keys}
    if sources == {"override"} or sources == {"launcher"}:
        keys: list[object] = [k[1] for k in env_keys]  # type: ignore[index]
    elif "override" in sources:
        missing = [r for r, k in enumerate(env_keys) if not k or k[0] != "override"]
        raise ValueError(f"{OVERRIDE_VAR} is set on some ranks but not on group ranks {missing}; "
                         "set it on every rank or on none")
    else:
        keys = [host for _, host in entries]
    hosts: dict[object, str] = {}
    for rank, (key, (_, host)) in enumerate(zip(keys, entries)):
        if hosts.setdefault(key, host) != host:
            raise ValueError(f"group rank {rank} claims node {key!r} but runs on host {host!r}, while another "
                             f"rank of that node runs on {hosts[key]!r}; ranks of one node must share a host "
                             "(check SLIPSTREAM_NODE / the launcher's node rank)")
    return keys


def detect_topology(group: dist.ProcessGroup | None = None) -> Topology:
    """Collective over ``group``: gather every rank's node key and build the topology."""
    mine = (node_key_from_env(), host_identity())
    size = dist.get_world_size(group)
    gathered: list = [None] * size
    dist.all_gather_object(gathered, mine, group=group)
    return Topology.from_keys(resolve_keys(gathered), dist.get_rank(group))
