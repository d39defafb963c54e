"""DeepSpeed's collectives through the core: a stand-in for ``deepspeed.comm``'s backend.

Every collective DeepSpeed issues goes through one module-level backend object,
``deepspeed.comm.comm.cdb``: ZeRO-1/2 gradient ``all_reduce`` (``reduce_scatter_tensor`` with
``zero.py``'s patch) and parameter ``all_gather_into_tensor``; ZeRO-3 async
``all_gather_into_tensor`` handles with ``.wait()``, ``reduce_scatter_tensor`` of gradients and
fp64 ``all_reduce`` of norms. The stand-in answers those three through the core's communicator
of the call's group (the pool's, running the tuner's plan) where the routing decision gives
the call to the core, and hands every other call, and every other attribute, to the original
object, reachable as ``__wrapped__``: a CUDA tensor on NCCL goes to DeepSpeed's own call,
whose handle comes back as it is, and builds no communicator. DeepSpeed's files are not edited.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from ...core_comm import CommConfig, Communicator, pool
from ..._common.patch import patch, unpatch

log = logging.getLogger("slipstream.deepspeed")

__all__ = ["CommBackend", "install_comm", "uninstall_comm", "installed_backend"]


class CommBackend:
    """Wraps a DeepSpeed ``TorchBackend``; ``__getattr__`` delegates what it does not define."""

    def __init__(self, wrapped, config: CommConfig) -> None:
        self.__wrapped__ = wrapped
        self.config = config
        self._groups: set = set()  # the groups whose communicators this stand-in used
        self.gathers_ahead: dict = {}
        """``data_ptr`` of a ZeRO flat parameter buffer -> its ``gather.GatherAhead``, which may
        take the buffer's all-gather (issued in pieces behind the next forward)."""

    def __getattr__(self, name):
        return getattr(self.__wrapped__, name)

    def communicator(self, group) -> Communicator:
        """The communicator of ``group`` (None: WORLD); the first call is a collective."""
        key = group if group is not None else dist.group.WORLD
        self._groups.add(key)
        # First collective on this group: every member is inside the same call.
        return pool.get(key, config=self.config)

    def takes(self, group, device_type: str, dtype, op=dist.ReduceOp.SUM) -> bool:
        """Whether the routing decision gives such a call on ``group`` to the core."""
        return pool.decide(group, device_type, dtype, op, config=self.config) is None

    def _core(self, group, tensor, op, kind: str, nbytes: int | None = None) -> Communicator | None:
        comm = pool.for_call(group, tensor, op, kind=kind, nbytes=nbytes, config=self.config)
        if comm is not None:
            self._groups.add(group if group is not None else dist.group.WORLD)
        return comm

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        op = self.__wrapped__._reduce_op(op)
        comm = self._core(group, tensor, op, "all_reduce")
        if comm is None:
            return self.__wrapped__.all_reduce(tensor, op, group=group, async_op=async_op)
        return comm.all_reduce(tensor, op, async_op=async_op)

    def reduce_scatter_tensor(self, output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=None, async_op=False,
                              valid=None):
        """``valid``: the real part of each block (``Communicator.reduce_scatter``), from ``zero.py``;
        DeepSpeed's own call, where the decision leaves it there, moves every block whole."""
        op = self.__wrapped__._reduce_op(op)
        comm = self._core(group, input_tensor, op, "reduce_scatter")
        if comm is None:
            return self.__wrapped__.reduce_scatter_tensor(output_tensor, input_tensor, op, group=group,
                                                          async_op=async_op)
        return comm.reduce_scatter(output_tensor, input_tensor, op, async_op=async_op, valid=valid)

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        ahead = self.gathers_ahead.get(output_tensor.data_ptr())
        if ahead is not None and not async_op and ahead.take(output_tensor, input_tensor, group):
            return None
        comm = self._core(group, input_tensor, dist.ReduceOp.SUM, "all_gather",
                          output_tensor.numel() * output_tensor.element_size())
        if comm is None:
            return self.__wrapped__.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                                           async_op=async_op)
        return comm.all_gather(output_tensor, input_tensor, async_op=async_op)

    def destroy_process_group(self, group=None):
        if group is None:  # DeepSpeed's call without a group destroys every group
            self.close()
        else:
            pool.close(group)
            self._groups.discard(group)
        return self.__wrapped__.destroy_process_group(group)

    def close(self) -> None:
        for group in self._groups:
            pool.close(group)
        self._groups.clear()


def installed_backend() -> CommBackend | None:
    import deepspeed.comm.comm as ds_comm

    return ds_comm.cdb if isinstance(ds_comm.cdb, CommBackend) else None


def install_comm(config: CommConfig) -> CommBackend:
    """Swap DeepSpeed's backend object for the stand-in. Idempotent: an installed stand-in with
    the same config is kept; one with another config is replaced, its communicators closed
    (every rank calls this at the same point, before its first collective). DeepSpeed's
    distributed backend must be initialised first."""
    import deepspeed.comm.comm as ds_comm

    if ds_comm.cdb is None or not ds_comm.cdb.is_initialized():
        raise RuntimeError("deepspeed.comm is not initialised: call deepspeed.init_distributed() first")
    current = installed_backend()
    if current is not None and current.config == config:
        return current
    if current is not None:
        log.info("slipstream: DeepSpeed comm settings changed; communicators rebuilt with %s", config)
        uninstall_comm()
    patch(ds_comm, "cdb", CommBackend(ds_comm.cdb, config), owner="deepspeed")
    return ds_comm.cdb


def uninstall_comm() -> None:
    """Put DeepSpeed's own backend object back (no-op when not installed)."""
    import deepspeed.comm.comm as ds_comm

    current = installed_backend()
    if current is not None:
        current.close()
        unpatch(ds_comm, "cdb")
