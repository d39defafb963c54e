"""How the tuner runs one measurement: the buffers of a call, the call itself, the
candidates the communicator can run it with, and a plan that always gives one choice.
"""

from __future__ import annotations

import torch

from ..communicator import Communicator
from ..routing import Choice


class _Fixed:
    """A plan that always returns one choice (None: the communicator's own rules)."""

    __slots__ = ("choice",)

    def __init__(self, choice: Choice | None) -> None:
        self.choice = choice

    def choose(self, kind, nbytes, dtype):
        return self.choice


def collective_buffers(kind: str, nbytes: int, dtype: torch.dtype, world: int):
    """``(output, input)``, uninitialised, for a full buffer of ``nbytes``: allreduce's tensor,
    reduce-scatter's input, allgather's output (as ``bench comm``). Zero them before timing:
    sums of zeros stay finite."""
    numel = max(world, nbytes // torch.empty(0, dtype=dtype).element_size() // world * world)
    if kind == "all_reduce":
        inp = torch.empty(numel, dtype=dtype)
        return inp, inp
    small, full = torch.empty(numel // world, dtype=dtype), torch.empty(numel, dtype=dtype)
    return (small, full) if kind == "reduce_scatter" else (full, small)


def call_collective(comm: Communicator, kind: str, out: torch.Tensor, inp: torch.Tensor) -> None:
    if kind == "all_reduce":
        comm.all_reduce(inp)
    elif kind == "reduce_scatter":
        comm.reduce_scatter(out, inp)
    else:
        comm.all_gather(out, inp)


def _candidates(comm: Communicator, kind: str, inp: torch.Tensor,
                chunks: tuple[int, ...]) -> tuple[Choice | None, list[Choice]]:
    """The communicator's own choice for this call, and the other ways it can run it (one
    hierarchical chunk size per distinct number of chunks). ``(None, [])``: nothing to choose."""
    if comm.hier is not None:
        others = [Choice("stock")]
        if kind == "all_reduce":
            nbytes, by_count = inp.numel() * inp.element_size(), {}
            for c in sorted(set(chunks) | {comm.config.chunk_bytes}):
                if -(-nbytes // c) not in by_count or c == comm.config.chunk_bytes:
                    by_count[-(-nbytes // c)] = c
            others += [Choice("hierarchical", c) for c in by_count.values()]
        else:
            others.append(Choice("hierarchical"))
    elif comm.shm is not None:
        others = [Choice("stock"), Choice("shm")]
    else:
        return None, []
    saved, comm.plan = comm.plan, None
    try:
        algo, _ = comm.algorithm(inp, kind=kind)
    finally:
        comm.plan = saved
    chunk = comm.config.chunk_bytes if algo == "hierarchical" and kind == "all_reduce" else None
    default = Choice(algo, chunk)
    return default, [c for c in others if c != default]
