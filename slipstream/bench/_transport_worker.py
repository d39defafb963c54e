"""One rank of ``slipstream bench transport``; started by torch.distributed.run on every rank.

Each rank allreduces its own tensor with its peers on the other nodes (the ranks of the same
local index: the inter-node step of the hierarchical path), through gloo and through
``MultiConnInter`` with each connection count. Every transport gets its own listening ports
from ``--port-base`` on, so that each connection has a port of its own (the emulated cluster's
per-connection caps key on ports). Results are checked against gloo once (small integers sum
exactly), then the implementations are timed in rotation (which goes first changes every
iteration). An iteration's time is the slowest rank's, from a barrier to the end of the
allreduce. Rank 0 writes the raw times as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from slipstream.core_comm.transport.tcp import MultiConnInter, endpoint_from_env


def _inter_group(world: int, per_node: int) -> dist.ProcessGroup:
    """This rank's peers: one rank of each node, same local index (every rank builds all)."""
    if per_node == 1:
        return dist.group.WORLD
    mine = None
    for local in range(per_node):
        group = dist.new_group(list(range(local, world, per_node)))
        if dist.get_rank() % per_node == local:
            mine = group
    return mine


def _transports(group, counts: list[int], port_base: int, timeout_s: float) -> dict[str, MultiConnInter]:
    address, _ = endpoint_from_env()
    world, out, base = dist.get_world_size(), {}, port_base
    for k in counts:
        out[f"K={k}"] = MultiConnInter(group, connections=k, timeout_s=timeout_s, address=address,
                                       ports=range(base, base + world * k))
        base += world * k
    return out


def _check(impls: dict, source: torch.Tensor, group) -> None:
    ref = source.clone()
    dist.all_reduce(ref, group=group)
    for name, t in impls.items():
        got = source.clone()
        t.all_reduce(got, dist.ReduceOp.SUM)
        if not torch.equal(got, ref):
            raise RuntimeError(f"rank {dist.get_rank()}: {name} allreduce differs from gloo; refusing to time")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--size", type=int, required=True, help="bytes of fp32 per rank")
    parser.add_argument("--connections", required=True, help="comma-separated K")
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--port-base", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    group = _inter_group(world, per_node)
    counts = [int(k) for k in args.connections.split(",")]
    impls: dict = {"gloo": None, **_transports(group, counts, args.port_base, args.timeout_s)}
    gen = torch.Generator().manual_seed(rank)
    source = torch.randint(-8, 9, (args.size // 4,), generator=gen).float()
    _check({k: v for k, v in impls.items() if v is not None}, source, group)
    x = source.clone()
    names = list(impls)

    def timed(name: str) -> float:
        x.copy_(source)
        dist.barrier()
        start = time.perf_counter()
        if impls[name] is None:
            dist.all_reduce(x, group=group)
        else:
            impls[name].all_reduce(x, dist.ReduceOp.SUM)
        return time.perf_counter() - start

    for _ in range(args.warmup):
        for name in names:
            timed(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.iters):
        for name in names[i % len(names):] + names[:i % len(names)]:
            times[name].append(timed(name))
        if rank == 0:
            print(f"iteration {i}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.0f} ms" for n in names), flush=True)
    slowest = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    for t in impls.values():
        if t is not None:
            t.close()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(world_size=world, ranks_per_node=per_node, size_bytes=source.numel() * 4,
                           times_s={n: slowest[i].tolist() for i, n in enumerate(names)}), f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from slipstream.cluster.worker import leave

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave()
