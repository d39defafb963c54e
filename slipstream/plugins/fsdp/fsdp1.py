"""FSDP1 (``FullyShardedDataParallel``): the sharded gradient reduce-scatter through the core,
as a comm hook with FSDP's own pre- and post-division: torch's ``reduce_scatter_hook`` (or, for
``NO_SHARD``, ``allreduce_hook``) with the collective handed to the core's communicator of the
group. The parameter all-gathers go through the group's backend, and so does a gradient the
routing decision leaves to the group (CUDA on NCCL): torch's own hook then. torch cannot remove a
registered hook, so ``register`` records a change whose undo (``slipstream.disable``) sends the
hook's calls to torch's own default hooks from then on.
"""

from __future__ import annotations

import torch

from ..._common.patch import change
from ...core_comm import pool

__all__ = ["register", "slipstream_fsdp1_hook"]

_ROUTED = "_slipstream_routed"  # on the hook's state: False once the registry undid the hook


def slipstream_fsdp1_hook(state, grad: torch.Tensor, output: torch.Tensor | None) -> None:
    """``state``: torch's ``DefaultState`` (process group, pre/post-division factors)."""
    kind = "all_reduce" if output is None else "reduce_scatter"
    comm = pool.for_call(state.process_group, grad, kind=kind) if getattr(state, _ROUTED, True) else None
    if comm is None:  # undone, or the group's own collective: torch's own hooks
        from torch.distributed.algorithms._comm_hooks import default_hooks

        return default_hooks.allreduce_hook(state, grad) if output is None else \
            default_hooks.reduce_scatter_hook(state, grad, output)
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    if output is None:
        comm.all_reduce(grad)
        target = grad
    else:
        comm.reduce_scatter(output, grad)
        target = output
    if state.gradient_postdivide_factor > 1:
        target.div_(state.gradient_postdivide_factor)


def register(model) -> None:
    """Register the hook on an FSDP1 root module (before its first backward)."""
    from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

    state = DefaultState(model.process_group)
    model.register_comm_hook(state, slipstream_fsdp1_hook)
    change(("fsdp1", id(model)), f"{type(model).__name__}: FSDP1 gradient reduce-scatter through the core",
           lambda: setattr(state, _ROUTED, False), owner="fsdp", target=model)
