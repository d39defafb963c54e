"""One rank of ``slipstream tune``; started by torch.distributed.run on every rank.

Tunes (or loads the cache), then with ``--compare`` times the communicator's fixed default
against the tuned plan on each size, alternating which goes first, each call timed from a
barrier, the slowest rank's time kept; at least ``--iters`` calls each, more for small sizes
(about 2 s per side). Rank 0 writes the plan and the times as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from slipstream.core_comm import Communicator
from slipstream.core_comm.tuner.measure import call_collective, collective_buffers
from slipstream.core_comm.tuner.tuner import KINDS, Tuner


def _once(comm: Communicator, plan, kind: str, out: torch.Tensor, inp: torch.Tensor) -> float:
    comm.plan = plan
    dist.barrier()
    t0 = time.perf_counter()
    call_collective(comm, kind, out, inp)
    return time.perf_counter() - t0


def _compare(default: Communicator, tuned: Communicator, plan, sizes: list[int], iters: int) -> list[dict]:
    """``default`` runs with no plan, ``tuned`` (which may be ``default``) with ``plan``."""
    records = []
    runs = {"default": (default, None), "tuned": (tuned, plan)}
    for kind in KINDS:
        for nbytes in sizes:
            out, inp = collective_buffers(kind, nbytes, torch.float32, default.world)
            out.zero_(), inp.zero_()
            times = {name: [] for name in runs}
            warm = torch.tensor([_once(*runs[name], kind, out, inp) for name in runs], dtype=torch.float64)
            dist.all_reduce(warm, op=dist.ReduceOp.MAX)
            # Small sizes are noisy (4 ranks share 2 cores): about 2 s of calls per side.
            n = max(iters, min(2000, int(2.0 / warm.max().item())))
            for i in range(n):
                for name in (("default", "tuned") if i % 2 == 0 else ("tuned", "default")):
                    times[name].append(_once(*runs[name], kind, out, inp))
            slowest = torch.tensor([times["default"], times["tuned"]], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            full = out if kind == "all_gather" else inp
            default.plan = None
            default_algo, _ = default.algorithm(inp, kind=kind)
            tuned.plan = plan
            tuned_algo, _ = tuned.algorithm(inp, kind=kind)
            choice = plan.choose(kind, inp.numel() * inp.element_size(), inp.dtype)
            records.append(dict(kind=kind, size_bytes=full.numel() * full.element_size(),
                                default_algorithm=default_algo,
                                tuned_algorithm=tuned_algo,
                                tuned_chunk_bytes=choice.chunk_bytes if choice else None,
                                default_times_s=slowest[0].tolist(), tuned_times_s=slowest[1].tolist()))
    return records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, required=True)
    parser.add_argument("--dtypes", required=True)
    parser.add_argument("--cache-dir")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--compare", default="", help="full-buffer bytes, comma-separated")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    default = Communicator(None)
    t0 = time.perf_counter()
    dtypes = tuple(getattr(torch, d) for d in args.dtypes.split(","))
    plan = Tuner(default, budget_s=args.budget, dtypes=dtypes, cache_dir=args.cache_dir).tune(force=args.force)
    tune_s = time.perf_counter() - t0
    compare = []
    if args.compare:
        config = plan.apply(default.config)
        # Same config: the same communicator, its plan switched per call.
        tuned = Communicator(None, config=config, plan=plan) if config != default.config else default
        compare = _compare(default, tuned, plan, [int(s) for s in args.compare.split(",")], args.iters)
        if tuned is not default:
            tuned.close()
    if dist.get_rank() == 0:
        topo = default.topology
        with open(args.out, "w") as f:
            json.dump(dict(plan=plan.to_json(), source=plan.source, tune_s=tune_s, world_size=default.world,
                           node_sizes=list(topo.node_sizes), unavailable=default.unavailable,
                           compare=compare), f)
    default.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    from slipstream.cluster.worker import leave

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave()
