"""Fast collectives shared by every adapter: shared-memory CPU-Reduce inside a node and
hierarchical collectives across nodes (``collectives/``, ``transport/``), behind one
communicator per process group (``pool``, ``communicator``) routed by one rule (``routing``),
the tuner (``tuner/``), the ``slipstream`` backend (``backend/``) and per-path call counts
(``counters``). Never imports an optional framework.
"""

from .._common import lazy

__all__ = ["Choice", "CommConfig", "Communicator", "Plan", "ShmComm", "ShmError", "Topology", "Work", "counters",
           "detect_topology", "pool"]

__getattr__, __dir__ = lazy.attributes(__name__, {
    "counters": ".counters", "pool": ".pool", "ShmComm": ".collectives.shm", "ShmError": ".collectives.shm",
    "Communicator": ".communicator", "CommConfig": ".config", "Choice": ".routing", "Plan": ".routing",
    "Topology": ".topology", "detect_topology": ".topology", "Work": ".work"})
