"""FSDP2's parameter all-gathers and gradient reduce-scatters through the core, on the group
the user's model already runs on (gloo, NCCL, or slipstream's own backend; docs/fsdp.md).

The extension point is torch's own: ``FSDPModule.set_custom_all_gather`` /
``set_custom_reduce_scatter`` (torch >= 2.8). Each call goes to the pool's communicator of the
group FSDP passes (built on the first call: every rank of the group is in it), which sends it
to the group's own collective when the routing rule refuses it. Asynchronous calls come back
as a ``torch.distributed.Work`` (FSDP's prefetch waits on it). A module whose FSDP state has
several parameter groups (a per-parameter mesh) stays on the stock comms, with one warning.

A module whose parameters the routing decision leaves to their group (CUDA on NCCL) keeps
FSDP2's own comms, untouched, and its own stream overlap (``comm.overlap`` changes nothing
there); the record says so. A call that reaches a comm object anyway (a group the decision
leaves to NCCL, an HSDP replica group) is FSDP2's own call, its stock ``Work`` handed back.
"""

from __future__ import annotations

import functools
import os
import weakref

import torch
import torch.distributed as dist

from ...core_comm import pool
from ...core_comm.config import CommConfig
from ..._common import lazy, record
from ..._common.record import note_stack, warn_once
from ..._common.patch import change, forget, patch, unpatch
from .._adapter import note_overlap_choice
from . import overlap as _overlap

__all__ = ["apply", "remove", "SlipstreamAllGather", "SlipstreamReduceScatter", "is_applied"]

_ORIGINALS = "_slipstream_fsdp_comms"  # on each switched module: its param groups' comms before
_OVERLAPPED = "_slipstream_fsdp_overlap"  # on each module switched with overlap: its groups' settings before
_PREFETCH = "_slipstream_fsdp_prefetch"  # on the model: the forward prefetches chained, to put back


def _api():
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError as e:  # pragma: no cover - torch < 2.8
        raise ImportError("slipstream's FSDP2 adapter needs torch >= 2.8 (FSDPModule.set_custom_all_gather)") from e
    return FSDPModule, AllGather, ReduceScatter


@functools.cache
def _classes():
    _, AllGather, ReduceScatter = _api()

    class _Core:
        def __init__(self, config: CommConfig | None = None, deferral: _overlap.Deferral | None = None) -> None:
            self.config = config
            self.deferral = deferral
            """Where ``overlap.py`` issues this module's reductions during backward (None: they block)."""

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

    class SlipstreamAllGather(_Core, AllGather):
        """FSDP2's parameter all-gather through the core's communicator of FSDP's group."""

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            comm = pool.for_call(group, input_tensor, kind="all_gather", nbytes=_nbytes(output_tensor),
                                 config=self.config)
            if comm is None:  # the group's own, as FSDP2's DefaultAllGather
                return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
            work = comm.all_gather(output_tensor, input_tensor, async_op=async_op)
            return work.returning([output_tensor]) if async_op else None

    class SlipstreamReduceScatter(_Core, ReduceScatter):
        """FSDP2's gradient reduce-scatter (AVG, SUM, PREMUL_SUM) through the core."""

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            comm = pool.for_call(group, input_tensor, op, kind="reduce_scatter", config=self.config)
            if comm is None:  # the group's own, as FSDP2's DefaultReduceScatter
                return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
            if not async_op and self.deferral is not None and self.deferral.take("reduce_scatter"):
                self.deferral.issued("reduce_scatter", comm.reduce_scatter(output_tensor, input_tensor, op,
                                                                           async_op=True))
                return None
            work = comm.reduce_scatter(output_tensor, input_tensor, op, async_op=async_op)
            return work.returning([output_tensor]) if async_op else None

    return SlipstreamAllGather, SlipstreamReduceScatter


__getattr__, __dir__ = lazy.attributes(__name__, {"SlipstreamAllGather": lambda: _classes()[0],
                                                  "SlipstreamReduceScatter": lambda: _classes()[1]})


def apply(model: torch.nn.Module, config: CommConfig | None = None) -> list[str]:
    """Route the collectives of every FSDP2 module in ``model`` (``fully_shard`` applied)
    through the core. Returns the names of the modules switched (already switched ones
    included). Idempotent; ``remove`` undoes it. ``config``: the communicators' settings
    (None: ``SLIPSTREAM_*`` / defaults)."""
    FSDPModule, _, _ = _api()
    if config is not None and not isinstance(config, CommConfig):
        raise TypeError(f"config must be a CommConfig, got {type(config).__name__}")
    gather_cls, scatter_cls = _classes()
    overlap = (config if config is not None else pool.default_config()).overlap
    modules = [(name, module) for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    if not modules:
        raise ValueError(f"{type(model).__name__} has no FSDP2 module: call fully_shard on it (and its layers) first")
    switched, kept, during = [], [], False
    # this call's reductions in flight, where overlap engages; under "auto" a trial says when
    deferral = _overlap.Deferral(_trial(model, modules) if overlap == "auto" else None)
    for name, module in modules:
        label = name or type(module).__name__
        if _ORIGINALS in vars(module):
            switched.append(label)
            continue
        groups = _overlap.param_groups(module._get_fsdp_state())
        if len(groups) > 1:
            warn_once(f"FSDP module {label!r} has {len(groups)} parameter groups (a per-parameter mesh): "
                      "torch's custom-comm hook refuses it, so its collectives stay stock")
            continue
        why = _stays_stock(module._get_fsdp_state(), config)
        if why:
            kept.append(why)
            continue
        before = [(g._all_gather_comm, g._reduce_scatter_comm) for g in groups]
        module.set_custom_all_gather(gather_cls(config))
        # on a device with streams FSDP2 overlaps its own collectives: left as it is
        on_cpu = overlap is not False and all(g.device.type == "cpu" for g in groups)
        module.set_custom_reduce_scatter(scatter_cls(config, deferral if on_cpu else None))
        vars(module)[_ORIGINALS] = before
        if on_cpu:
            vars(module)[_OVERLAPPED] = _overlap.engage(groups, deferral)
            during = True
        for g in groups:  # HSDP: the replicate group's all-reduce of each reduce-scatter output
            replicate = getattr(g.mesh_info, "replicate_process_group", None)
            if replicate is not None:
                _HSDP.route(replicate, config, deferral if on_cpu else None)
        switched.append(label)
    if switched:
        ref = weakref.ref(model)
        change(("fsdp2", id(model)), f"{type(model).__name__}: FSDP2 all-gathers and reduce-scatters through the core",
               lambda: ref() is not None and remove(ref()), owner="fsdp", target=model)
    during = during or any(_OVERLAPPED in vars(m) for _, m in modules)
    if during and _PREFETCH not in vars(model):
        vars(model)[_PREFETCH] = _overlap.chain_forward_prefetch([(n, m) for n, m in modules if _OVERLAPPED in vars(m)])
    trial = deferral.trial if deferral.groups else None  # None: no module engaged by this call
    if trial is not None:
        trial.on_decided = note_overlap_choice("fsdp", "reductions_during_backward")
        what = trial.reason
    elif not switched:
        what = None
    elif not during:
        what = "off" if overlap is False else "no module on a CPU (FSDP2's own streams)"
    else:
        what = "on" if overlap is True else "as an earlier apply set it"
    note_stack("fsdp", engaged=bool(switched), by="slipstream.fsdp.apply", modules_through_the_core=len(switched),
               hsdp_replicate_all_reduce="through the core" if _HSDP.groups else None,
               reductions_during_backward=trial.pending if trial is not None else during, overlap=what,
               modules_left_to_fsdp=f"{len(kept)} ({kept[0]})" if kept else None)
    if kept and not switched:  # no communicator will be built to start the job's line: say it now
        record.start()
    return switched


def _trial(model: torch.nn.Module, modules: list):
    """The ``OverlapTrial`` of one ``apply``, keyed by the model's parameters, its FSDP modules
    and the job's layout; it agrees over the default group (every rank of the job runs the
    same backward passes; under either mode the same collectives, in the same order)."""
    from ...core_comm.tuner.overlap import OverlapTrial

    params = [p for p in model.parameters() if p.requires_grad]
    key = {"stack": "fsdp2", "model": type(model).__name__, "params": sum(p.numel() for p in params),
           "tensors": len(params), "dtype": str(params[0].dtype) if params else "", "modules": len(modules),
           "world": dist.get_world_size(), "ranks_per_node": os.environ.get("LOCAL_WORLD_SIZE", "")}
    return OverlapTrial("FSDP2 reductions", key, dist.group.WORLD)


def _stays_stock(state, config: CommConfig | None) -> str | None:
    """Why a module keeps FSDP2's own comms (``state``: its FSDP state): the routing decision
    for its device on its parameter groups' shard and replica groups (a module without
    parameters of its own: the default group) leaves their calls there (CUDA on NCCL), or None."""
    groups = _overlap.param_groups(state)
    if not groups:
        return pool.decide(None, state._device.type, torch.float32, config=config)
    for g in groups:
        for attr in ("shard_process_group", "replicate_process_group"):
            group = getattr(g.mesh_info, attr, None)
            why = pool.decide(group, g.device.type, torch.float32, config=config) if group is not None else None
            if why:
                return why
    return None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def remove(model: torch.nn.Module) -> None:
    """Put back the comms each switched module had before ``apply``; a no-op elsewhere."""
    forget(("fsdp2", id(model)))
    _overlap.unchain(vars(model).pop(_PREFETCH, []))
    for module in model.modules():
        before = vars(module).pop(_ORIGINALS, None)
        if before is None:
            continue
        groups = _overlap.param_groups(module._get_fsdp_state())
        if _OVERLAPPED in vars(module):
            _overlap.release(groups, vars(module).pop(_OVERLAPPED))
        for group, (gather, scatter) in zip(groups, before):
            group._all_gather_comm, group._reduce_scatter_comm = gather, scatter
            replicate = getattr(group.mesh_info, "replicate_process_group", None)
            if replicate is not None:
                _HSDP.unroute(replicate)


class _HsdpAllReduce:
    """HSDP's all-reduce across replicas is a plain ``dist.all_reduce`` inside FSDP2's
    ``_fsdp_collectives`` (no custom-comm hook for it in torch 2.13): that module's ``dist``
    becomes a ``_DistView`` from the first HSDP module switched to the last (an exact undo)."""

    def __init__(self) -> None:
        self.groups: dict[int, list] = {}  # id(group) -> [group, config, modules switched on it, deferral]

    def route(self, group, config, deferral) -> None:
        entry = self.groups.setdefault(id(group), [group, config, 0, deferral])
        entry[2] += 1
        if len(self.groups) == 1 and entry[2] == 1:
            from torch.distributed.fsdp._fully_shard import _fsdp_collectives

            patch(_fsdp_collectives, "dist", _DistView(self), owner="fsdp")

    def unroute(self, group) -> None:
        entry = self.groups.get(id(group))
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] == 0:
            del self.groups[id(group)]
        if not self.groups:
            from torch.distributed.fsdp._fully_shard import _fsdp_collectives

            unpatch(_fsdp_collectives, "dist")


class _DistView:
    """``torch.distributed`` with ``all_reduce`` of the routed groups through the core; every
    other call and group is torch's own."""

    def __init__(self, routes: _HsdpAllReduce) -> None:
        self._routes = routes

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        entry = self._routes.groups.get(id(group))
        if entry is None:
            return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        comm = pool.for_call(group, tensor, op, kind="all_reduce", config=entry[1])
        if comm is None:
            return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        deferral = entry[3]
        if not async_op and deferral is not None and deferral.take("all_reduce"):
            deferral.issued("all_reduce", comm.all_reduce(tensor, op, async_op=True))
            return None
        work = comm.all_reduce(tensor, op, async_op=async_op)
        return work.returning([tensor]) if async_op else None


_HSDP = _HsdpAllReduce()


def is_applied(model: torch.nn.Module) -> bool:
    return any(_ORIGINALS in vars(m) for m in model.modules())
