"""Emulated multi-node clusters on one machine, and the launcher that runs ranks on them.

Nodes are network namespaces joined by rate-limited veth links (``emulated.py``, over the raw
``ip`` / ``tc`` commands of ``_netns.py``); one node runs on loopback. Each node's launcher
forks its ranks after importing what they need (``_forkrun.py``), or is ``torch.distributed.run``
where an accelerator is visible. Used by the benchmarks, ``slipstream tune``/``env`` and the recipes; the core
(``core_comm``) never imports it.
"""

from ._netns import NetnsError
from .emulated import ClusterSpec, EmulatedCluster, LaunchError, launch, parse_rate

__all__ = ["ClusterSpec", "EmulatedCluster", "LaunchError", "NetnsError", "launch", "parse_rate"]
