"""FSDP2's gradient reductions run while backward goes on (``"comm": {"overlap": true}``, or
where ``"auto"``'s trial measures it faster: ``Deferral.trial``).

On a CPU, FSDP2 calls its collectives synchronously: ``foreach_reduce`` reduce-scatters a
layer's gradients (and, under HSDP, all-reduces the result across replicas) and the rank waits,
and the parameter all-gathers it prefetches during backward block too. For the modules
``fsdp2.apply`` switched with overlap on:

- each layer of a list of layers prefetches the next one's parameters in forward
  (``chain_forward_prefetch``), so that its all-gather runs while the layer computes;
- the reduction that ends a layer's ``foreach_reduce`` is issued on the communicator's thread
  and backward goes on: the reduce-scatter, or under HSDP the all-reduce across replicas (the
  one that crosses the nodes; the reduce-scatter before it, inside a node, still blocks);
- the all-gathers FSDP2 prefetches are issued asynchronously (its ``unshard_async_op``), so
  they queue behind the reductions in flight instead of waiting for them, and FSDP2 waits on
  their ``Work`` where it needs the parameters;
- every reduction in flight is waited for at the end of backward (the root's final
  callback), before anything reads a gradient; a failed one raises there.

The reductions in flight are the state of one ``apply``: a ``Deferral`` its reduce-scatter
comm objects hold (FSDP2 passes the comm object into ``foreach_reduce``, where the patch finds
it), and its HSDP replica groups' routes too; nothing of it is module-global.

A reduction is issued this way only where ``foreach_reduce`` does nothing with its result
afterwards but make the sharded gradients views of it: the division done by the collective
(AVG), no cast to another dtype, no gradient already there to add to, no post-accumulate-grad
hook, no CPU offload, no all-reduce hook, HSDP reducing rather than accumulating. Any other
call blocks, as FSDP2's own. The same values are reduced in the same order: results are
bit-equal to the blocking path's.
"""

from __future__ import annotations

import functools
import inspect

from ..._common.patch import patch, unpatch
from ...core_comm.tuner.overlap import OverlapTrial
from ...core_comm.work import InFlight

__all__ = ["Deferral", "chain_forward_prefetch", "engage", "param_groups", "release", "unchain"]


def param_groups(state) -> list:
    """The parameter groups of an FSDP2 module's state (``module._get_fsdp_state()``): torch
    2.13 keeps a list (``_fsdp_param_groups``), torch 2.11 one group or None
    (``_fsdp_param_group``)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


class Deferral:
    """The reductions in flight of the overlapped FSDP2 modules of one ``apply``."""

    __slots__ = ("queue", "issuing", "trial", "groups")

    def __init__(self, trial: OverlapTrial | None = None) -> None:
        self.trial = trial
        """With ``"overlap": "auto"``: the trial that says, backward by backward, whether the
        reductions run during backward (None: always)."""
        self.groups: list = []
        """With a trial: ``(parameter group, its own unshard_async_op)`` of every engaged module."""
        self.queue = InFlight()
        """The reductions issued, in order, not yet waited for (the core's one in-flight
        queue: every one waited for, the first failure raised naming its call). Unbounded:
        FSDP2 frees nothing a reduction writes before the end of backward."""
        self.issuing: str | None = None
        """While a deferred ``foreach_reduce`` runs: the call to issue asynchronously,
        ``"reduce_scatter"`` or ``"all_reduce"``."""

    @property
    def active(self) -> bool:
        """Whether this backward's reductions are issued during it."""
        return self.trial is None or self.trial.overlap

    def take(self, kind: str) -> bool:
        """Whether the ``kind`` call now running is the one to issue asynchronously."""
        return self.issuing == kind

    def step_done(self) -> None:
        """A backward ended (every reduction waited for): where it reduced gradients (the last
        of an accumulation: FSDP2's ``set_requires_gradient_sync(False)`` leaves the others
        unreduced), the trial times the step and says how the next one runs, the prefetched
        all-gathers asynchronous with the reductions or not."""
        if self.trial is None or not any(group.reduce_grads for group, _ in self.groups):
            return
        self.trial.step_done()
        for group, own in self.groups:
            group.unshard_async_op = True if self.trial.overlap else own

    def issued(self, kind: str, work) -> None:
        self.queue.push(f"FSDP2 {kind}", [work])

    def drain(self) -> None:
        """Wait for every reduction in flight, in order; the first failure raises once all
        were waited for (none is left running on a buffer FSDP2 frees)."""
        self.queue.drain()


_ENGAGED = [0]
"""Modules switched with overlap in this process: the two class patches stay while there is
one (a count for installing and removing them; no call reads it)."""


def engage(groups, deferral: Deferral) -> list:
    """Overlap the FSDP2 parameter ``groups`` of one module, with ``deferral``'s reductions
    (from its trial's first overlapped step, under ``"auto"``); returns what ``release`` puts back."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group, _fsdp_state

    before = [g.unshard_async_op for g in groups]
    for g, own in zip(groups, before):
        if deferral.trial is not None:
            deferral.groups.append((g, own))
        g.unshard_async_op = deferral.active or own
    if _ENGAGED[0] == 0:
        patch(_fsdp_param_group, "foreach_reduce", _deferring(_fsdp_param_group.foreach_reduce), owner="fsdp")
        patch(_fsdp_state.FSDPState, "_root_post_backward_final_callback",
              _draining(_fsdp_state.FSDPState._root_post_backward_final_callback), owner="fsdp")
    _ENGAGED[0] += 1
    return before


def release(groups, before: list) -> None:
    """Undo ``engage`` for one module (after waiting for what is in flight)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group, _fsdp_state

    deferrals = _deferrals(groups)
    first = _drain(deferrals)
    if first is not None:
        raise first
    for g, was in zip(groups, before):
        g.unshard_async_op = was
    for deferral in deferrals:
        deferral.groups = [(g, own) for g, own in deferral.groups if all(g is not x for x in groups)]
    _ENGAGED[0] -= 1
    if _ENGAGED[0] == 0:
        unpatch(_fsdp_param_group, "foreach_reduce")
        unpatch(_fsdp_state.FSDPState, "_root_post_backward_final_callback")


def chain_forward_prefetch(named: list) -> list:
    """Each of ``named`` (``(name, FSDP module)``, overlap engaged) that is the i-th child of a
    list of layers prefetches the (i+1)-th in forward, where its user set no forward prefetch:
    on a CPU FSDP2 all-gathers a module's parameters as its forward starts and waits, so that
    otherwise no forward all-gather runs behind compute; in overlapped steps the prefetch is
    asynchronous and runs while the i-th layer computes (one layer's parameters held more).
    Returns what ``unchain`` puts back."""
    by_name, chained = dict(named), []
    for name, module in named:
        parent, _, index = name.rpartition(".")
        following = by_name.get(f"{parent}.{int(index) + 1}") if parent and index.isdigit() else None
        state = module._get_fsdp_state()
        if following is not None and not state._states_to_forward_prefetch:
            chained.append(state)
            module.set_modules_to_forward_prefetch([following])
    return chained


def unchain(chained: list) -> None:
    """Undo ``chain_forward_prefetch``: the modules it chained prefetch nothing again."""
    for state in chained:
        state._states_to_forward_prefetch = []


def _deferrals(groups) -> list[Deferral]:
    """The deferrals of FSDP2 parameter ``groups``' reduce-scatter comm objects, each once."""
    found = (getattr(getattr(g, "_reduce_scatter_comm", None), "deferral", None) for g in groups)
    return list({id(d): d for d in found if d is not None}.values())


def _drain(deferrals: list[Deferral]) -> Exception | None:
    """Drain every one of ``deferrals``; the first failure, returned (None: none failed)."""
    first = None
    for deferral in deferrals:
        try:
            deferral.drain()
        except Exception as e:  # noqa: BLE001 - the caller raises the first
            first = first or e
    return first


def _deferring(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def foreach_reduce(*args, **kwargs):
        found = _deferrable(signature, args, kwargs)
        if found is None:
            return original(*args, **kwargs)
        deferral, kind = found
        deferral.issuing = kind
        try:
            return original(*args, **kwargs)
        finally:
            deferral.issuing = None

    return foreach_reduce


def _draining(original):
    @functools.wraps(original)
    def final_callback(self, *args, **kwargs):
        states = getattr(getattr(self, "_state_ctx", None), "all_states", None) or [self]
        deferrals = _deferrals(g for state in states for g in param_groups(state))
        try:
            original(self, *args, **kwargs)
        except BaseException:
            _drain(deferrals)  # the callback's own error is the one raised
            raise
        first = _drain(deferrals)  # every one waited for, the first failure raised
        if first is not None:
            raise first
        for deferral in deferrals:  # the same point of every backward on every rank
            deferral.step_done()

    return final_callback


def _deferrable(signature, args, kwargs) -> tuple[Deferral, str] | None:
    """The deferral of this ``foreach_reduce``'s comm object and which of its calls may run on
    after it returns (see the module docstring), or None: every call blocks."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    try:
        a = signature.bind(*args, **kwargs).arguments
        comm, grads, params = a["reduce_scatter_comm"], a["unsharded_grads"], a["fsdp_params"]
        deferral = getattr(comm, "deferral", None)
        if deferral is None or not deferral.active or a["device"].type != "cpu" or not grads:
            return None
        reduce_dtype = a["reduce_dtype"] or grads[0].dtype
        group, replicas = a["reduce_scatter_group"], a["all_reduce_group"]
        _, postdivide, _, _ = _get_gradient_divide_factors(group, replicas, reduce_dtype, "cpu",
                                                           a["gradient_divide_factor"],
                                                           a.get("force_sum_reduction_for_comms", False))
    except (KeyError, TypeError, AttributeError):  # another torch's foreach_reduce: stock
        return None
    if postdivide is not None or reduce_dtype != (a["orig_dtype"] or reduce_dtype) or a["all_reduce_hook"] is not None:
        return None
    if any(p.sharded_param.grad is not None or p.offload_to_cpu
           or getattr(p.sharded_param, "_post_accumulate_grad_hooks", None) for p in params):
        return None
    if replicas is None:
        return (deferral, "reduce_scatter") if group is not None and group.size() > 1 else None
    if not a["all_reduce_grads"] or a["partial_reduce_output"] is not None:
        return None
    return deferral, "all_reduce"
