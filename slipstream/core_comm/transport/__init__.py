"""How a rank exchanges with its peers on the other nodes: through the group's own gloo
(``gloo``), or over K TCP connections per peer (``tcp``, whose sockets and threads are
``_lanes``). Both implement ``InterTransport``, the three calls ``Hierarchical`` makes."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["InterTransport"]


class InterTransport(Protocol):
    """How a rank exchanges with its peers on the other nodes (one per node, in node order
    given by ``Hierarchical``'s inter positions). With ``async_op`` each call returns a handle
    whose ``wait()`` completes the call (the data is in place after it)."""

    def all_reduce(self, shard: torch.Tensor, op, async_op: bool = False): ...
    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op, async_op: bool = False): ...
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False): ...
