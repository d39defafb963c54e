"""Fast collectives shared by every adapter: shared-memory CPU-Reduce inside a node and
hierarchical collectives across nodes, behind one communicator per process group (``pool``),
with per-path call counts (``counters``).

Never imports an optional framework.
"""

from . import counters, pool
from .communicator import Choice, Communicator, Plan, Work
from .config import CommConfig
from .collectives.shm import ShmComm, ShmError
from .topology import Topology, detect_topology

__all__ = ["Choice", "CommConfig", "Communicator", "Plan", "ShmComm", "ShmError", "Topology", "Work", "counters",
           "detect_topology", "pool"]
