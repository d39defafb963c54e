"""How a rank exchanges with its peers on the other nodes: through the group's own gloo
(``gloo``), or over K TCP connections per peer (``tcp``, whose sockets and threads are
``_lanes``); both implement ``InterTransport``."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["InterTransport"]


class InterTransport(Protocol):
    """The three calls ``Hierarchical`` makes to the peers (one per node, in the order of its
    inter positions). With ``async_op`` each returns a handle whose ``wait()`` completes it.
    ``scratch(numel, dtype)`` gives the call its temporaries, valid until it is waited on
    (``scratch.Scratch``; None: new tensors)."""

    def all_reduce(self, shard: torch.Tensor, op, async_op: bool = False, scratch=None): ...
    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op, async_op: bool = False,
                       lengths: list[int] | None = None, scratch=None): ...
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False): ...
