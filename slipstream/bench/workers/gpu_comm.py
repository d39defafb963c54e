"""One rank of ``slipstream bench gpu``'s shared-GPU stage: ranks sharing one GPU over gloo
(NCCL refuses two ranks on one device) with CUDA tensors, which the core's communicator of the
gloo group stages through pinned host memory (``pool.get(group)``).

First the stream-race probe of every async wrapper on this layout (``gpu_probe.staged``), then
the collectives: the core's all-reduce,
reduce-scatter and all-gather run against gloo's own on the same CUDA tensors, in turns, each
timed from a barrier to a device sync (the slowest rank's time, as ``bench comm``).

Before timing, each op runs once both ways on the same inputs (normal draws in ``--dtype``):
the all-gather must be equal, the reductions within the dtype's rounding (the core sums bf16 in
fp32, gloo in bf16). Where gloo refuses CUDA tensors for an op, its peer is gloo on host copies
(what a user would write) and the record says so. On a CPU dry run the same code runs on CPU
tensors (the core's shared-memory path). Rank 0 appends each result's row to ``--rows`` as it
comes (the stage's table, ``gpu.Rows``).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from slipstream.cluster.worker import cores_per_rank, in_turns, run_worker, time_from_barrier
from slipstream.core_comm.compat import all_gather_into_tensor as _all_gather  # torch 2.13's or 2.11's name
from slipstream.core_comm.compat import reduce_scatter_tensor as _reduce_scatter
from slipstream.core_comm.tuner.measure import call_collective

__all__ = ["measure"]

OPS = ("all_reduce", "reduce_scatter", "all_gather")


def _gloo(op: str, out: torch.Tensor, inp: torch.Tensor) -> None:
    if op == "all_reduce":
        dist.all_reduce(inp)
    elif op == "reduce_scatter":
        _reduce_scatter(out, inp)
    else:
        _all_gather(out, inp)


def _via_host(op: str, out: torch.Tensor, inp: torch.Tensor) -> None:
    """gloo on host copies of device tensors."""
    host_in = inp.cpu()
    host_out = host_in if op == "all_reduce" else out.cpu()
    _gloo(op, host_out, host_in)
    (inp if op == "all_reduce" else out).copy_(host_out)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Case:
    """One op's buffers: ``source`` is copied into ``inp`` before every call (all-reduce is in place)."""

    def __init__(self, op: str, numel: int, dtype: torch.dtype, device: torch.device, world: int) -> None:
        rank = dist.get_rank()
        n_in = numel // world if op == "all_gather" else numel
        self.op, self.device = op, device
        self.source = torch.randn(n_in, generator=torch.Generator().manual_seed(rank)).to(device=device, dtype=dtype)
        self.inp = self.source.clone()
        n_out = {"all_reduce": numel, "reduce_scatter": numel // world, "all_gather": numel}[op]
        self.out = self.inp if op == "all_reduce" else torch.empty(n_out, dtype=dtype, device=device)

    def result(self, call) -> torch.Tensor:
        self.inp.copy_(self.source)
        call(self.op, self.out, self.inp)
        _sync(self.device)
        return self.out.clone()

    def timed(self, call) -> float:
        self.inp.copy_(self.source)
        _sync(self.device)
        return time_from_barrier(lambda: (call(self.op, self.out, self.inp), _sync(self.device)))


def _stock_call(case: _Case) -> tuple:
    """(gloo's call, its label, its result): gloo on the tensors, or on host copies where it refuses them."""
    try:
        return _gloo, "gloo", case.result(_gloo)
    except (RuntimeError, ValueError) as e:
        if case.device.type != "cuda":
            raise
        label = f"gloo on host copies (gloo refused CUDA tensors: {str(e).splitlines()[0][:120]})"
        return _via_host, label, case.result(_via_host)


def _tolerance(op: str, ref: torch.Tensor, world: int, dtype: torch.dtype) -> float:
    """Largest difference rounding explains: an all-gather none; a reduction, one rounding of
    the dtype (``eps``) per rank at the largest magnitude of the result."""
    if op == "all_gather":
        return 0.0
    return world * torch.finfo(dtype).eps * ref.abs().max().item()


def measure(args) -> dict:
    from slipstream.core_comm import pool

    from . import gpu_probe
    from .gpu import Rows

    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.cpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows = Rows(args.rows) if args.rows and rank == 0 else None
    where = f"{world} ranks, gloo, " + ("CUDA tensors (staged)" if device.type == "cuda" else "CPU")

    def record(r: dict) -> None:
        if rows is not None:
            rows.add(f"race probe: {r['name']}", *gpu_probe.row(r))

    probes = gpu_probe.staged(device, on_result=record)
    if rows is not None:
        rows.add(f"race probe verdict ({where})", *gpu_probe.verdict(probes, device.type == "cuda"))
    dtype = getattr(torch, args.dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    numel = max(args.bytes // itemsize // world, 1) * world
    comm = pool.get(None)
    records = []
    for op in OPS:
        records.append(_measure_op(comm, op, numel, dtype, device, world, args))
        if rows is not None:
            rows.add(*_row(records[-1], args.dtype, where))
    pool.close(None)
    return {"world_size": world, "device": str(device), "dtype": args.dtype, "probes": probes, "records": records}


def _measure_op(comm, op: str, numel: int, dtype, device, world: int, args) -> dict:
    case = _Case(op, numel, dtype, device, world)
    stock, label, ref = _stock_call(case)

    def ours(o, out, inp):
        call_collective(comm, o, out, inp)

    diff = (case.result(ours).double() - ref.double()).abs().max().item()
    tol = _tolerance(op, ref, world, dtype)
    times = in_turns({"gloo": lambda: case.timed(stock), "slipstream": lambda: case.timed(ours)},
                     args.iters, args.warmup)
    algorithm, why = comm.algorithm(case.inp, dist.ReduceOp.SUM, op)
    return {"op": op, "bytes": numel * case.inp.element_size(),  # the full buffer, as bench comm's sizes
            "stock": label, "algorithm": algorithm, "why": why, "max_abs_diff": diff, "tolerance": tol,
            "equal_within_tolerance": diff <= tol, "times_s": times}


def _row(r: dict, dtype: str, where: str) -> tuple[str, str, str]:
    from slipstream.bench.report import format_size

    gloo, ours = statistics.median(r["times_s"]["gloo"]), statistics.median(r["times_s"]["slipstream"])
    same = "" if r["equal_within_tolerance"] else "; DIFFERS from gloo beyond rounding"
    return (f"{r['op']} {format_size(r['bytes'])} {dtype}", f"{gloo / ours:.2f}x gloo{same}",
            f"{where}: slipstream ({r['algorithm']}) {ours * 1e3:.1f} ms, {r['stock']} {gloo * 1e3:.1f} ms (medians of "
            f"{len(r['times_s']['gloo'])}, slowest rank); max abs diff from gloo {r['max_abs_diff']:.3g} "
            f"(rounding allows {r['tolerance']:.3g})")


if __name__ == "__main__":
    run_worker(measure, options={"--bytes": int, "--dtype": "bfloat16", "--iters": 10, "--warmup": 2, "--cpu": False,
                                 "--rows": None}, threads=cores_per_rank)
