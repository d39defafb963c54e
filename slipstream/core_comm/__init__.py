"""Fast collectives shared by every adapter: shared-memory CPU-Reduce inside a node and
hierarchical collectives across nodes (``collectives/``, ``transport/``), behind one
communicator per process group (``pool``, ``communicator``) routed by one rule (``routing``),
the tuner (``tuner/``), the ``slipstream`` backend (``backend/``) and per-path call counts
(``counters``). Never imports an optional framework.
"""

from . import counters, pool
from .collectives.shm import ShmComm, ShmError
from .communicator import Communicator
from .config import CommConfig
from .routing import Choice, Plan
from .topology import Topology, detect_topology
from .work import Work

__all__ = ["Choice", "CommConfig", "Communicator", "Plan", "ShmComm", "ShmError", "Topology", "Work", "counters",
           "detect_topology", "pool"]
