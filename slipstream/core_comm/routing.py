"""The routing rule of the core: which calls may take a fast path, how ops map onto the
shared-memory kernels, and the flat-buffer helpers of the coalesced forms.

The communicator applies it to every call; the backend asks it (``refusal``) before it
builds a communicator, so both decide alike.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
import torch.distributed as dist

from .collectives.shm import ShmComm

__all__ = ["chain", "check_coalesced", "refusal", "split_op", "unflatten"]

ReduceOp = dist.ReduceOp


def split_op(op) -> tuple:
    """``(op, factor)``: PREMUL_SUM(factor) is ``(SUM, factor)``, every other op ``(op, None)``.
    ``op`` may be a ``ReduceOp`` (with its factor) or a bare ``RedOpType``."""
    if not isinstance(op, ReduceOp.RedOpType):  # a ReduceOp object, which may carry a factor
        if op.op == ReduceOp.PREMUL_SUM:
            return ReduceOp.SUM, op.__getstate__()[1]
        return op.op, None
    return op, None


def refusal(tensor: torch.Tensor, op=ReduceOp.SUM, others=()) -> str | None:
    """Why a collective of ``tensor`` (and ``others``, e.g. its output) with ``op`` cannot take
    a fast path, or None. Depends only on what every rank of a correct program passes alike."""
    if tensor.device.type not in ("cpu", "cuda"):
        return f"device {tensor.device} is not supported"
    for t in (tensor, *others):
        if t.layout != torch.strided:
            return f"layout {t.layout} is not supported"
        if t.device != tensor.device:
            return f"tensors on different devices: {tensor.device} and {t.device}"
    base, factor = split_op(op)
    if factor is not None and not tensor.dtype.is_floating_point:
        return f"PREMUL_SUM of {tensor.dtype} is not defined"
    return ShmComm.supports(tensor.new_empty(0, device="cpu"), base)


def check_coalesced(kind: str, tensors: list, others: list | None = None) -> None:
    if not tensors or (others is not None and len(others) != len(tensors)):
        raise ValueError(f"{kind}: needs one or more tensors (and as many outputs as inputs)")
    first = tensors[0]
    for t in (*tensors, *(others or ())):
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"{kind}: tensors of different dtypes or devices: {first.dtype} on "
                             f"{first.device} and {t.dtype} on {t.device}")


def unflatten(flat: torch.Tensor, tensors: list) -> None:
    at = 0
    for t in tensors:
        t.copy_(flat[at:at + t.numel()].view_as(t))
        at += t.numel()


def chain(work, finish) -> Future:
    """A future that completes once ``work`` (the core's ``Work`` or a stock ``dist.Work``)
    has and ``finish()`` has run; an error of either is the future's error."""
    done: Future = Future()

    def then(error: BaseException | None) -> None:
        try:
            if error is not None:
                raise error
            finish()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(e)
        else:
            done.set_result(None)

    if isinstance(work, dist.Work):
        def stock_done(f) -> None:
            try:
                f.wait()
            except BaseException as e:  # noqa: BLE001
                then(e)
            else:
                then(None)

        work.get_future().add_done_callback(stock_done)
    else:
        work.get_future().add_done_callback(lambda f: then(f.exception()))
    return done
