"""The segment a ``ShmComm`` group shares (layout in ``shm.py``'s docstring): the fields of a
rank's control line and the codes written into them, creating and mapping the segment, and
reading what peers wrote (a control line as text, whether a peer's process is gone).
"""

from __future__ import annotations

import mmap
import os
import secrets

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

SUPPORTED_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int32, torch.int64, torch.uint8,
)
_DTYPE_CODE = {dt: i + 1 for i, dt in enumerate(SUPPORTED_DTYPES)}
SUPPORTED_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MAX, ReduceOp.MIN)
_OP_CODE = {op: i + 1 for i, op in enumerate(SUPPORTED_OPS)}
_KIND_CODE = {"all_reduce": 1, "reduce_scatter": 2, "all_gather": 3,
              "cma_all_reduce": 4, "cma_reduce_scatter": 5, "cma_all_gather": 6}

_LINE = 64  # bytes of one control line; also the alignment of slots and slices
_STEP, _SEQ, _KIND, _NUMEL, _DTYPE, _OP, _PID, _ADDR = range(8)
_LINE_WORDS = _LINE // 8
_ABORTED = -1  # the seq of a rank that failed a call begun with ``start``


class ShmError(RuntimeError):
    """A shared-memory collective could not complete (peer died, timed out, mismatched call)."""


def _process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _describe(fields) -> str:
    """Text for the (kind, numel, dtype, op) fields of a control line."""
    kind, numel, dtype, op = (int(v) for v in fields[:4])
    kinds = {v: k for k, v in _KIND_CODE.items()}
    dtypes = {v: k for k, v in _DTYPE_CODE.items()}
    ops = {v: k for k, v in _OP_CODE.items()}
    return f"{kinds.get(kind)} of {numel} x {dtypes.get(dtype)} ({ops.get(op)})"


def _map_segment(group, rank: int, nbytes: int) -> tuple[mmap.mmap, str]:
    """Create (rank 0) or open (others) the group's segment and unlink its name once all
    ranks have mapped it. Collective over ``group``."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    path = None
    fd = -1
    try:
        error = None
        if rank == 0:
            path = f"/dev/shm/slipstream-{secrets.token_hex(16)}"
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                os.posix_fallocate(fd, 0, nbytes)  # fail now, not with SIGBUS mid-collective
            except OSError as e:
                error = f"cannot allocate {nbytes} bytes in /dev/shm: {e}"
        box = [path, error]  # every rank learns of a failure, so all fall back alike
        dist.broadcast_object_list(box, src=src, group=group)
        path, error = box
        if error:
            raise ShmError(error)
        if rank != 0:
            fd = os.open(path, os.O_RDWR)
        mm = mmap.mmap(fd, nbytes)
        dist.barrier(group=group)
        return mm, path
    finally:
        if fd >= 0:
            os.close(fd)
        if rank == 0 and path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
