"""One rank of ``slipstream bench transport``: its allreduce with the ranks of the same local
index on the other nodes, through gloo and through ``MultiConnInter`` with each connection
count. Every transport gets its own listening ports from ``--port-base`` on, so that each
connection has a port of its own (the emulated cluster's per-connection caps key on ports).
Results are checked against gloo once (small integers sum exactly) before the timing.
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import torch
import torch.distributed as dist

from slipstream.cluster.worker import in_turns, run_worker, time_from_barrier
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


def measure(args: argparse.Namespace) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    group = _inter_group(world, per_node)
    counts = [int(k) for k in args.connections.split(",")]
    impls: dict = {"gloo": None, **_transports(group, counts, args.port_base, args.timeout_s)}
    gen = torch.Generator().manual_seed(rank)
    source = torch.randint(-8, 9, (args.size // 4,), generator=gen).float()
    _check({k: v for k, v in impls.items() if v is not None}, source, group)
    x = source.clone()

    def timed(name: str) -> float:
        x.copy_(source)
        if impls[name] is None:
            return time_from_barrier(lambda: dist.all_reduce(x, group=group))
        return time_from_barrier(lambda: impls[name].all_reduce(x, dist.ReduceOp.SUM))

    def progress(i: int, times: dict[str, list[float]]) -> None:
        if rank == 0:
            print(f"iteration {i}: " + ", ".join(f"{n} {t[-1] * 1e3:.0f} ms" for n, t in times.items()), flush=True)

    times = in_turns({name: partial(timed, name) for name in impls}, args.iters, args.warmup, after=progress)
    for t in impls.values():
        if t is not None:
            t.close()
    return dict(world_size=world, ranks_per_node=per_node, size_bytes=source.numel() * 4, times_s=times)


if __name__ == "__main__":
    # --size: bytes of fp32 per rank; --connections: the K to compare, comma-separated
    run_worker(measure, options={"--size": int, "--connections": str, "--iters": int, "--warmup": int,
                                 "--port-base": int, "--timeout-s": 120.0})
