"""What the core moves and reduces: dtypes, reduction ops and collective kinds, their codes in
the shared-memory control lines and on the TCP transport's wire, and the reductions themselves.

Codes are 1-based positions in these tables (0 means unset); ranks of one job run the same
version, so a code means the same on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["COMBINE", "DTYPES", "KINDS", "OPS", "REDUCIBLE_DTYPES", "ROWS_IN_SCRATCH_FROM", "cannot_reduce", "code",
           "describe", "level_op", "name_of", "overlaps", "reduce_rows", "split_op"]

ReduceOp = dist.ReduceOp

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
"""Every dtype the core moves (the TCP transport's wire)."""
REDUCIBLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8)
"""The dtypes the shared-memory kernels reduce (every path of the communicator)."""
OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MAX, ReduceOp.MIN)
"""The ops the core reduces with (AVG for floating dtypes; PREMUL_SUM is a scale, then SUM)."""
KINDS = ("all_reduce", "reduce_scatter", "all_gather")
"""The collectives the core runs."""

COMBINE = {ReduceOp.SUM: torch.add, ReduceOp.PRODUCT: torch.mul, ReduceOp.MAX: torch.maximum,
           ReduceOp.MIN: torch.minimum}
"""Element-wise combine of two operands by op (AVG is a SUM, then one division)."""


def code(table: tuple, value) -> int:
    """``value``'s code in ``table``: its 1-based position."""
    return table.index(value) + 1


def name_of(table: tuple, code_: int) -> str:
    """The entry of ``table`` with code ``code_``, as text (the code itself when unknown)."""
    return str(table[code_ - 1]) if 1 <= code_ <= len(table) else str(code_)


def cannot_reduce(dtype: torch.dtype, op) -> str | None:
    """Why the core cannot reduce ``dtype`` with ``op`` (a bare op, no factor), or None."""
    if dtype not in REDUCIBLE_DTYPES:
        return f"dtype {dtype} is not supported"
    if op not in OPS:
        return f"op {op} is not supported"
    if op == ReduceOp.AVG and not dtype.is_floating_point:
        return f"AVG of {dtype} is not defined here"
    return None


def split_op(op) -> tuple:
    """``(op, factor)``: PREMUL_SUM(factor) is ``(SUM, factor)``, every other op ``(op, None)``.
    ``op`` may be a ``ReduceOp`` (with its factor) or a bare ``RedOpType``."""
    if not isinstance(op, ReduceOp.RedOpType):  # a ReduceOp object, which may carry a factor
        if op.op == ReduceOp.PREMUL_SUM:
            return ReduceOp.SUM, op.__getstate__()[1]
        return op.op, None
    return op, None


def level_op(op):
    """The op of each level of a multi-level reduction: AVG sums (and divides once at the end)."""
    return ReduceOp.SUM if op == ReduceOp.AVG else op


def describe(kind: str, tensor: torch.Tensor | None, op=None) -> str:
    """A call in the words of errors: ``all_reduce of 1000 float32 on cpu, SUM``."""
    if tensor is None:
        return kind
    what = f"{kind} of {tensor.numel()} {str(tensor.dtype).removeprefix('torch.')} on {tensor.device.type}"
    if op is None:
        return what
    base, factor = split_op(op)
    return f"{what}, " + (base.name if factor is None else f"PREMUL_SUM({float(factor):g})")


ROWS_IN_SCRATCH_FROM = 32 << 10
"""Rows of this many elements or more are reduced in scratch: their fp32 copies (128 KiB and
up) are blocks glibc maps or keeps. Below, torch's reduction is faster: 4 bf16 rows of 16 Ki
elements took 15 us against 23 row by row; of 64 Ki, 53-62 against 47 (1 thread, AMD EPYC)."""


def _accumulated(rows: torch.Tensor, op, scratch) -> torch.Tensor:
    """The fp32 sum (or product) of fp16/bf16 ``rows: (world, m)``, in rank order, in ``scratch``."""
    m = rows.shape[1]
    acc, row = scratch(m, torch.float32), scratch(m, torch.float32)
    acc.copy_(rows[0])
    for r in rows[1:]:
        row.copy_(r)
        if op == ReduceOp.PRODUCT:
            acc.mul_(row)
        else:
            acc.add_(row)
    return acc


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes of contiguous ``a`` and ``b`` overlap."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def reduce_rows(rows: torch.Tensor, out: torch.Tensor, op, world: int, scratch=None) -> None:
    """``out: (m,) = op over rows: (world, m)`` in one torch op; fp16/bf16 sums and products
    accumulate in fp32 (given ``scratch(numel, dtype)`` and ``ROWS_IN_SCRATCH_FROM`` elements,
    in two fp32 rows of it, row after row: torch's fp32 reduction of fp16 makes an fp32 copy
    of every row, 2 of 6 kinds of temporary left in a 2-node soak's rank); integer sums wrap
    around like gloo's. AVG divides by ``world``."""
    if op == ReduceOp.MAX:
        torch.amax(rows, 0, out=out)
    elif op == ReduceOp.MIN:
        torch.amin(rows, 0, out=out)
    else:
        fn = torch.prod if op == ReduceOp.PRODUCT else torch.sum
        if out.dtype in (torch.float16, torch.bfloat16):
            small = scratch is None or out.numel() < ROWS_IN_SCRATCH_FROM
            acc = fn(rows, 0, dtype=torch.float32) if small else _accumulated(rows, op, scratch)
            if op == ReduceOp.AVG:
                acc.div_(world)
            out.copy_(acc)
        else:
            fn(rows, 0, dtype=out.dtype, out=out)
            if op == ReduceOp.AVG:
                out.div_(world)
