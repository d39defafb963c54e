"""ZeRO-1/2's parameter all-gather after the optimizer step, in flight behind the next forward.

After its step each rank of DeepSpeed's stage 1/2 optimizer has updated only its own
partition of the flat parameter buffer, then all-gathers the others' (``all_gather_dp_groups``):
a blocking collective, every core idle, before the next forward may start. While the step's
buckets are overlapped (``Deferred.active``), ``GatherAhead`` takes that call instead (it reaches
the core's stand-in, ``comm_backend.py``) and issues it as ``PIECES`` all-gathers in the buffer's
order: DeepSpeed flattens the parameters in the model's order, owner after owner. On one node
each piece is the same slice of every partition. Across nodes whose ranks are consecutive, a
node's partitions are one block of the buffer: its ranks first gather the block inside the node
(shared memory, blocking), then each piece sends the next slice of every node's block, cut
among its ranks, so that another node gets the block's first layers first at the link's whole
rate (with equal slices of every partition, no partition was complete before the last piece:
node 1 waited 1.8 s a ZeRO-2 step for the first layers at 100 Mbit/s). They run on the
communicator's thread, each copied into the flat buffer as it arrives, and the step returns.

Nothing reads a parameter before its bytes are there. Until every piece is in, a dispatch mode on
the training thread (``_AwaitParams``) looks at each operator's tensors and waits for the pieces a
tensor of the flat buffer covers: the next forward's first layers run while later pieces travel,
whatever reads the parameters (a layer, a tied weight, an average kept in the loop). The mode
leaves at the first layer that starts once every piece is in, or at the end of the model's
forward. The model's ``state_dict``, the next step, a forward on
another thread, a read-only view the mode cannot see (``.numpy()``) through ``settle`` wait for
every piece first. The bytes gathered are DeepSpeed's, in its order: results are bit-equal to the
blocking gather's. Not taken (DeepSpeed's blocking gather runs): a compiled model (the mode would
keep its graphs from running), another dispatch mode already active, a call the routing leaves to
the stock backend (NCCL), a blocking step of ``"overlap": "auto"``'s trial.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_leaves

from ..._common.patch import change, patch
from ...core_comm.work import InFlight, Work
from .overlap import OWNER

__all__ = ["GatherAhead", "PIECES", "patch_gather_ahead"]

PIECES = 8
"""All-gathers the parameter gather is cut into (fewer where a partition is small)."""
MIN_PIECE = 1 << 16
"""Fewest elements of one partition in a piece."""


class _Piece:
    __slots__ = ("storage", "ranges", "work")

    def __init__(self, storage: int, ranges: list[tuple[int, int]], work: Work) -> None:
        self.storage = storage
        """``data_ptr`` of the flat buffer's storage."""
        self.ranges = ranges
        """Element ranges of that storage the piece writes: the other ranks' slices."""
        self.work = work


class GatherAhead:
    """The parameter gathers of one ZeRO-1/2 optimizer in flight, and what waits for them."""

    __slots__ = ("backend", "active", "armed", "pending", "queue", "mode", "thread")

    def __init__(self, backend, active: Callable[[], bool]) -> None:
        self.backend = backend
        """The core's stand-in for DeepSpeed's communication backend."""
        self.active = active
        """Whether this step's gather goes behind the next forward (the buckets' mode)."""
        self.armed = False
        """True inside the optimizer's step, when its gather may be taken."""
        self.pending: list[_Piece] = []
        """Pieces issued, not yet waited for, in order."""
        self.queue = InFlight()
        """The same pieces' handles: one failure rule (every piece waited for, the first error raised)."""
        self.mode: _AwaitParams | None = None
        """The dispatch mode on ``thread`` while pieces are pending."""
        self.thread: int | None = None

    # ------------------------------------------------------------ the optimizer's step

    def step(self, step, *args, **kwargs):
        """DeepSpeed's ``step``, its parameter gather issued in pieces when ``active``."""
        self.settle()
        self.armed = self.active() and _get_current_dispatch_mode() is None
        try:
            return step(*args, **kwargs)
        finally:
            self.armed = False
            if self.pending:
                self.mode, self.thread = _AwaitParams(self), threading.get_ident()
                self.mode.__enter__()

    def take(self, output: torch.Tensor, input: torch.Tensor, group) -> bool:
        """DeepSpeed's ``all_gather_into_tensor(output, input, group)`` of the step's flat buffer,
        issued in pieces (True), or left to the caller (False)."""
        world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        size = input.numel()
        if (not self.armed or output.dim() != 1 or not output.is_contiguous() or output.numel() != world * size
                or input.data_ptr() != output.data_ptr() + rank * size * output.element_size()
                or not self.backend.takes(group, input.device.type, input.dtype)):
            return False
        comm = self.backend.communicator(group)
        count = max(1, min(PIECES, size // MIN_PIECE))
        bounds = [size * j // count for j in range(count + 1)]
        # Across nodes (ranks consecutive on each, CPU): a block is a node's partitions, which
        # its ranks first gather inside the node; each piece then sends the next slice of every
        # node's block, cut among its ranks, so the other nodes get the first layers first.
        topo = comm.topology
        by_node = comm.hier is not None and comm.shm is not None and topo.is_blocked and input.device.type == "cpu"
        local, block = (topo.local_size, topo.node) if by_node else (1, rank)
        span, pos = local * size, rank - block * local
        mine = output[block * span:(block + 1) * span]
        if local > 1:
            comm.node_all_gather(mine, input)
        storage, base = output.untyped_storage().data_ptr(), output.storage_offset()
        others = [b for b in range(world // local) if b != block]
        pieces = [(local * start, end - start) for start, end in zip(bounds, bounds[1:])]
        sends = [mine[lo + pos * width:lo + (pos + 1) * width] for lo, width in pieces]
        # The core's pieces run one after another on its thread, each copied out before the
        # next: they share one piece's staging (the whole buffer's worth otherwise).
        shared = all(comm.algorithm(send, kind="all_gather")[0] != "stock" for send in sends)
        staging = output.new_empty(world * max(width for _, width in pieces)) if shared else None
        for (lo, width), send in zip(pieces, sends):
            staged = staging[:world * width] if shared else output.new_empty(world * width)
            work = comm.all_gather(staged, send, async_op=True,
                                   then=_copier(output, staged, others, span, lo, local * width))
            self.pending.append(_Piece(storage, [(base + b * span + lo, base + b * span + lo + local * width)
                                                 for b in others], work))
            self.queue.push("ZeRO parameter all-gather", [work])
        return True

    # ------------------------------------------------------------ waiting

    def wait_for(self, tensors) -> None:
        """Wait for the pending pieces that any of ``tensors`` reads."""
        for tensor in tensors:
            if not self.pending:
                return
            if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
                continue
            try:
                storage = tensor.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # sparse, or no storage of its own
                continue
            start = tensor.storage_offset()
            end = start + 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()) if n > 1)
            last = max((i for i, p in enumerate(self.pending) if p.storage == storage
                        and any(a < end and start < b for a, b in p.ranges)), default=-1)
            if last >= 0:
                self._wait_through(last)

    def settle(self) -> None:
        """Wait for every piece in flight; the dispatch mode leaves where it is on top."""
        if self.pending:
            self._wait_through(len(self.pending) - 1)
        if self.mode is not None and self.thread == threading.get_ident() and _get_current_dispatch_mode() is self.mode:
            mode, self.mode = self.mode, None
            mode.__exit__(None, None, None)

    def leave_when_done(self) -> None:
        """The dispatch mode leaves once every piece is in (a layer's start: outside any operator)."""
        if self.mode is not None and all(p.work.is_completed() for p in self.pending):
            self.settle()

    def settle_elsewhere(self) -> None:
        """Every piece waited for unless this is the thread whose operators the mode sees."""
        if self.pending and self.thread != threading.get_ident():
            self._wait_through(len(self.pending) - 1)

    def _wait_through(self, last: int) -> None:
        """Wait for pieces ``0..last`` (in order: they complete in order); a failed piece waits
        for every other and raises (the rank cannot go on with some parameters stale)."""
        done, self.pending = self.pending[:last + 1], self.pending[last + 1:]
        try:
            for _ in done:
                self.queue.pop()
        except BaseException:
            self.pending = []
            raise


def _returning_none(fn: Callable[[], None]):
    """A hook that runs ``fn()`` and returns None (a value would replace the module's input or output)."""
    def hook(*_) -> None:
        fn()
    return hook


def _copier(output: torch.Tensor, staged: torch.Tensor, others: list[int], span: int, lo: int, width: int):
    """Copy the other blocks' slices of a piece into ``output``: block ``b``'s ``width``
    elements of ``staged`` (blocks in order) go to ``output[b * span + lo:][:width]``."""
    def copy() -> None:
        for b in others:
            output[b * span + lo:b * span + lo + width].copy_(staged[b * width:(b + 1) * width])
    return copy


class _AwaitParams(TorchDispatchMode):
    """Waits, before each operator, for the pending pieces its tensors read."""

    def __init__(self, ahead: GatherAhead) -> None:
        super().__init__()
        self.ahead = ahead

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.ahead.pending:
            self.ahead.wait_for(tree_leaves((args, kwargs)))
        return func(*args, **kwargs)


def patch_gather_ahead(optimizer, backend, module: torch.nn.Module, active: Callable[[], bool]) -> GatherAhead | None:
    """Issue ``optimizer``'s parameter gather in pieces behind ``module``'s next forward while
    ``active()``; None where DeepSpeed's optimizer has no such gather (not stage 1/2). Every
    change goes through the patch registry (``status()`` lists it, ``disable()`` undoes it)."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:  # pragma: no cover - depends on the DeepSpeed version
        return None
    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or not hasattr(optimizer, "bit16_groups_flat"):
        return None
    ahead = GatherAhead(backend, active)
    flats = {flat.data_ptr() for flat in optimizer.bit16_groups_flat}
    for ptr in flats:
        backend.gathers_ahead[ptr] = ahead
    step = optimizer.step
    patch(optimizer, "step", lambda *a, **k: ahead.step(step, *a, **k), owner=OWNER)
    # each layer's start: the mode leaves once every piece is in (it costs each operator a call)
    handles = [m.register_forward_pre_hook(_returning_none(ahead.leave_when_done))
               for m in module.modules() if m is not module]
    handles += [module.register_forward_pre_hook(_returning_none(ahead.settle_elsewhere)),
                module.register_forward_hook(_returning_none(ahead.settle), always_call=True),
                module.register_state_dict_pre_hook(_returning_none(ahead.settle))]

    def undo() -> None:
        ahead.settle()
        for handle in handles:
            handle.remove()
        for ptr in flats:
            backend.gathers_ahead.pop(ptr, None)

    change(("zero-gather-ahead", id(optimizer)), f"{type(optimizer).__name__}'s parameter all-gather in pieces "
           "behind the next forward (hooks on the model, the communication backend's gather)", undo,
           owner=OWNER, target=optimizer)
    return ahead
