"""One rank of ``slipstream tune``: tunes (or loads the cache), then with ``--compare`` times
the communicator's fixed default against the tuned plan on each size in turns, each call from a
barrier, the slowest rank's time kept; at least ``--iters`` calls each, more for small sizes
(about 2 s per side)."""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from slipstream.cluster.worker import in_turns, run_worker, slowest, time_from_barrier
from slipstream.core_comm import Communicator
from slipstream.core_comm.ops import KINDS
from slipstream.core_comm.tuner import Tuner
from slipstream.core_comm.tuner.measure import call_collective, collective_buffers


def _once(comm: Communicator, plan, kind: str, out: torch.Tensor, inp: torch.Tensor) -> float:
    comm.plan = plan
    return time_from_barrier(lambda: call_collective(comm, kind, out, inp))


def _compare(default: Communicator, tuned: Communicator, plan, sizes: list[int], iters: int) -> list[dict]:
    """``default`` runs with no plan, ``tuned`` (which may be ``default``) with ``plan``."""
    records = []
    runs = {"default": (default, None), "tuned": (tuned, plan)}
    for kind in KINDS:
        for nbytes in sizes:
            out, inp = collective_buffers(kind, nbytes, torch.float32, default.world)
            out.zero_(), inp.zero_()
            calls = {name: partial(_once, *runs[name], kind, out, inp) for name in runs}
            warm = slowest({name: [call()] for name, call in calls.items()})
            # Small sizes are noisy (4 ranks share 2 cores): about 2 s of calls per side.
            n = max(iters, min(2000, int(2.0 / max(t for (t,) in warm.values()))))
            times = in_turns(calls, n)
            full = out if kind == "all_gather" else inp
            default.plan = None
            default_algo, _ = default.algorithm(inp, kind=kind)
            tuned.plan = plan
            tuned_algo, _ = tuned.algorithm(inp, kind=kind)
            choice = plan.choose(kind, inp.numel() * inp.element_size(), inp.dtype)
            records.append(dict(kind=kind, size_bytes=full.numel() * full.element_size(),
                                default_algorithm=default_algo, tuned_algorithm=tuned_algo,
                                tuned_chunk_bytes=choice.chunk_bytes if choice else None,
                                default_times_s=times["default"], tuned_times_s=times["tuned"]))
    return records


def tune(args: argparse.Namespace) -> dict:
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
    result = dict(plan=plan.to_json(), source=plan.source, tune_s=tune_s, world_size=default.world,
                  node_sizes=list(default.topology.node_sizes), unavailable=default.unavailable, compare=compare)
    default.close()
    return result


if __name__ == "__main__":
    # --compare: full-buffer bytes, comma-separated
    run_worker(tune, options={"--budget": float, "--dtypes": str, "--cache-dir": None, "--force": False,
                              "--compare": "", "--iters": 10})
