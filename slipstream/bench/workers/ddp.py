"""One rank of ``slipstream bench ddp``.

The default group is ``init_process_group("slipstream")``; the stock reference is a gloo group
of the same ranks (``new_group(backend="gloo")``: the same ``ProcessGroupGloo`` that
``init_process_group("gloo")`` makes). Two copies of one MLP, built from the same seed, are
wrapped in plain ``DistributedDataParallel``, one per group, and trained on the same
rank-dependent synthetic batches with SGD, a step of each in turn, so that both see the same
machine load. A third copy without DDP takes the same steps in the same turns: its step is
the compute alone, and a DDP step's time beyond it is the communication not hidden behind
compute (DDP's reducer waits in C++, out of the core's sight). Steps after ``--warmup`` are
timed; a step's time is the slowest rank's. ``comm_s``: per slipstream step, how long one of
its collectives was in flight (the core's timeline); ``link_bytes``: what all ranks sent
across the node links per slipstream step.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import slipstream  # noqa: F401 - registers the backend
from slipstream.cluster.worker import run_worker, slowest, timed_step, turns
from slipstream.core_comm import counters


def make_model(width: int, depth: int, seed: int = 0) -> torch.nn.Module:
    """``depth`` Linear(width, width) + GELU layers and a Linear(width, 1) head."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def batch(rank: int, step: int, size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, width, generator=gen)
    return x, x.sum(1, keepdim=True).sin()


def train(args: argparse.Namespace) -> dict:
    rank = dist.get_rank()
    groups = {"gloo": dist.new_group(backend="gloo"), "slipstream": dist.group.WORLD}
    models = {name: DDP(make_model(args.width, args.depth), process_group=g, bucket_cap_mb=args.bucket_mb)
              for name, g in groups.items()}
    models["compute"] = make_model(args.width, args.depth)
    opts = {name: torch.optim.SGD(m.parameters(), lr=args.lr) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in (*models, "comm")}
    counters.reset()
    for step in range(args.warmup + args.steps):
        x, y = batch(rank, step, args.batch, args.width)
        for name in turns(list(models), step):
            took, _ = timed_step(lambda: torch.nn.functional.mse_loss(models[name](x), y), opts[name])
            comm = counters.timeline.take()["comm_s"]
            if step >= args.warmup:
                times[name].append(took)
                times["comm"] += [comm] if name == "slipstream" else []
        if step == args.warmup - 1:
            counters.reset()
    weights = {name: torch.cat([p.detach().reshape(-1) for p in models[name].module.parameters()])
               for name in groups}
    return dict(world_size=dist.get_world_size(), params=weights["gloo"].numel(), times_s=slowest(times),
                link_bytes=_world_sum(counters.link_bytes(), groups["gloo"]) / args.steps,
                max_abs_weight_diff=(weights["slipstream"] - weights["gloo"]).abs().max().item(),
                weights_allclose=torch.allclose(weights["slipstream"], weights["gloo"], rtol=1.3e-6, atol=1e-5),
                weights_equal=bool(torch.equal(weights["slipstream"], weights["gloo"])))


def _world_sum(value: float, group) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item()


if __name__ == "__main__":
    run_worker(train, options={"--width": int, "--depth": int, "--batch": int, "--steps": int, "--warmup": int,
                               "--bucket-mb": 25.0, "--lr": 0.01},
               group="slipstream", threads=lambda: int(os.environ["OMP_NUM_THREADS"]))
