"""One rank of ``slipstream bench comm``.

For each op and size: run every implementation (stock, slipstream and, for allreduce,
DeepSpeed's shm op: see ``deepspeed_shm.py``) once on the same integer-valued input and require
results identical to stock's (small integers sum exactly in every dtype and order, so any
difference is a bug, not rounding), warm them up, then time them in turns. An iteration's time
is the slowest rank's, from a barrier to the end of the collective; below 4 MiB an iteration
runs the collective back to back several times (at most 50, as nccl-tests' ``iters`` do) and
counts the mean, so that the skew of ranks leaving the barrier (a few hundred microseconds with
4 ranks on 2 cores) does not swamp a latency of that order.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from slipstream.cluster.worker import in_turns, run_worker, time_from_barrier
from slipstream.core_comm.compat import all_gather_into_tensor as _all_gather  # torch 2.13's or 2.11's name
from slipstream.core_comm.compat import reduce_scatter_tensor as _reduce_scatter


# op -> impl -> f(comms, out, inp), comms: impl -> its communicator; allreduce works in place on
# inp. DeepSpeed's op is an allreduce only.
_CALLS = {
    "allreduce": {
        "stock": lambda c, o, i: dist.all_reduce(i),
        "slipstream": lambda c, o, i: c["slipstream"].all_reduce(i),
        "deepspeed": lambda c, o, i: c["deepspeed"](i),
    },
    "allgather": {
        "stock": lambda c, o, i: _all_gather(o, i),
        "slipstream": lambda c, o, i: c["slipstream"].all_gather(o, i),
    },
    "reduce_scatter": {
        "stock": lambda c, o, i: _reduce_scatter(o, i),
        "slipstream": lambda c, o, i: c["slipstream"].reduce_scatter(o, i),
    },
}


@dataclass(frozen=True)
class _Case:
    """Buffers of one op at one size."""

    op: str
    comms: dict[str, Any]  # impl -> slipstream's Communicator or DeepSpeed's op, for those that run
    inp: torch.Tensor
    out: torch.Tensor
    source: torch.Tensor  # copied into ``inp`` before every call: in-place ops change it

    def run(self, impl: str) -> None:
        _CALLS[self.op][impl](self.comms, self.out, self.inp)


def _case(op: str, numel: int, dtype: torch.dtype, comms: dict, world: int, seed: int) -> _Case:
    """``numel`` (a multiple of ``world``) elements in the full buffer: allreduce's tensor,
    allgather's output, reduce-scatter's input. Values are integers in [-8, 8]."""
    gen = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    in_numel = numel // world if op == "allgather" else numel
    source = torch.randint(-8, 9, (in_numel,), generator=gen).to(dtype)
    inp = source.clone()
    out_numel = {"allreduce": 0, "allgather": numel, "reduce_scatter": numel // world}[op]
    out = inp if op == "allreduce" else torch.empty(out_numel, dtype=dtype)
    return _Case(op, comms, inp, out, source)


def _algorithm(case: _Case, impl: str) -> str:
    """What the communicator runs for this case (it may hand a call to the stock collective)."""
    if impl == "stock":
        return dist.get_backend()
    if impl == "deepspeed":
        from .deepspeed_shm import algorithm

        return algorithm(case.inp.numel() * case.inp.element_size())
    kind = {"allreduce": "all_reduce", "allgather": "all_gather", "reduce_scatter": "reduce_scatter"}
    algorithm, why = case.comms["slipstream"].algorithm(case.inp, dist.ReduceOp.SUM, kind[case.op])
    return f"{algorithm}: {why}" if why else algorithm


_REP_BYTES, _MAX_REPS = 4 << 20, 50


def _reps(case: _Case) -> int:
    """Back-to-back calls per timed iteration: about 4 MiB of full buffers, 1 to 50 calls."""
    nbytes = max(case.inp.numel(), case.out.numel()) * case.inp.element_size()
    return max(1, min(_MAX_REPS, _REP_BYTES // max(1, nbytes)))


def _timed(case: _Case, impl: str) -> float:
    """Seconds per call. Repeated in-place sums may overflow to inf: a timing, not a result."""
    case.inp.copy_(case.source)
    return time_from_barrier(lambda: case.run(impl), _reps(case))


def _check(case: _Case, impls: list[str], op: str, nbytes: int) -> None:
    """Every impl's output equals the stock one's exactly; raise on every rank otherwise."""
    results = {}
    for impl in impls:
        case.inp.copy_(case.source)
        case.run(impl)
        results[impl] = case.out.clone()
    bad = torch.zeros(1)
    for impl, got in results.items():
        if not torch.equal(got, results["stock"]):
            diff = (got.double() - results["stock"].double()).abs()
            print(f"rank {dist.get_rank()}: {impl} {op} of {nbytes} bytes differs from stock: "
                  f"{int((diff > 0).sum())} of {diff.numel()} elements, max abs diff {diff.max().item()}",
                  flush=True)
            bad += 1
    dist.all_reduce(bad)
    if bad.item():
        raise RuntimeError(f"{op} of {nbytes} bytes: results differ from stock's "
                           "(see the ranks' lines above); refusing to report times")


def _communicators(impls: list[str], rank: int, world: int) -> dict[str, Any]:
    comms: dict[str, Any] = {}
    if "slipstream" in impls:
        from slipstream.core_comm import Communicator

        comms["slipstream"] = Communicator(None)
    if "deepspeed" in impls:
        from .deepspeed_shm import connect

        comms["deepspeed"] = connect(rank, world)
    return comms


def measure(args: argparse.Namespace) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    impls = args.impls.split(",")
    comms = _communicators(impls, rank, world)
    dtype = getattr(torch, args.dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    records = []
    for op in args.ops.split(","):
        for seed, nbytes in enumerate(int(s) for s in args.sizes.split(",")):
            numel = max(nbytes // itemsize // world, 1) * world
            case = _case(op, numel, dtype, comms, world, seed)
            here = [impl for impl in impls if impl in _CALLS[op]]
            if len(here) > 1:
                _check(case, here, op, numel * itemsize)
            times = in_turns({impl: partial(_timed, case, impl) for impl in here}, args.iters, args.warmup)
            records += [dict(op=op, size_bytes=numel * itemsize, impl=impl, times_s=times[impl],
                             algorithm=_algorithm(case, impl)) for impl in here]
            if rank == 0:
                print(f"done: {op} {numel * itemsize} bytes", flush=True)
    if "slipstream" in comms:
        comms["slipstream"].close()
    return dict(world_size=world, backend=dist.get_backend(), records=records)


if __name__ == "__main__":
    # With DeepSpeed's shm extension loaded (0.19.8), a rank now and then aborts in C++
    # teardown after every result is in ("terminate called without an active exception",
    # one CI run in about six): leave without that teardown once all ranks are done.
    run_worker(measure, options={"--ops": str, "--sizes": str, "--impls": str, "--dtype": str, "--iters": int,
                                 "--warmup": int}, destroy_group=lambda args: "deepspeed" not in args.impls.split(","))
