"""``slipstream bench comm``: collectives, slipstream vs the stock backend vs DeepSpeed's shm
allreduce, nccl-tests style.

Ranks are started with ``slipstream.cluster.launch``: one local node on loopback, or
``--nodes`` emulated nodes joined by ``--link``-limited links (root needed). The
implementations run in the same processes on the same buffers, alternating; each row is the
median over ``--iters`` of the slowest rank's time. Results are checked once per size (every
implementation's output must equal the stock one), and the run fails if they differ.

Implementations: ``stock`` (the process group's backend, gloo), ``slipstream`` (its
Communicator), and ``deepspeed``: the CPU shared-memory allreduce stock DeepSpeed builds
(``workers/deepspeed_shm.py`` says what it supports), for allreduce on one node in float32/bfloat16/float16
only. It is JIT-built the first time (about 1.5 minutes on 2 cores), before the ranks start and outside the
timings; the report gives that set-up time. Where it cannot run, the report says why in one
line and the others run.

Columns, as nccl-tests (n ranks, S the full buffer: allreduce's tensor, allgather's output,
reduce-scatter's input; GB/s are 10^9 bytes/s, so ``*_gbps`` fields are GB/s too):

- algbw = S / time; busbw = algbw x 2(n-1)/n (allreduce) or (n-1)/n (allgather, reduce-scatter).
- bound: the physical lower limit on the time. On one node, the least memory traffic (every
  rank's input read once and every output written once: 2nS for allreduce, (n+1)S for
  allgather and reduce-scatter) divided by the copy bandwidth measured at start (a 512 MiB
  tensor copy on all cores, read + write bytes). Across N nodes, the bytes that must cross
  each node's link, 2(N-1)/N x S (allreduce) or (N-1)/N x S, divided by the link rate (TCP's
  goodput is 95.6% of it at best: see ``cluster/emulated.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from slipstream.cluster import ClusterSpec, parse_rate
from slipstream.cluster.worker import add_cluster_options, cluster_spec, flags, launch_worker
from .report import emit, format_size, page, parse_size, table

__all__ = ["add_arguments", "run"]

OPS = ("allreduce", "allgather", "reduce_scatter")
IMPLS = ("stock", "slipstream", "deepspeed")
_BUS_FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n}
_MEMORY_BYTES = {"allreduce": lambda n: 2 * n, "allgather": lambda n: n + 1,
                 "reduce_scatter": lambda n: n + 1}  # x S, see the module docstring


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cluster_options(parser, ranks_per_node=4)
    parser.add_argument("--pin-nodes", action="store_true",
                        help="run each emulated node's ranks on their own share of the CPUs (taskset)")
    parser.add_argument("--sizes", default="4K,64K,1M,16M", help="buffer sizes (default 4K,64K,1M,16M)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated of {', '.join(OPS)}")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help="stock, plus slipstream and/or deepspeed (default all three; deepspeed where it runs)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per impl (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per impl first (default 2)")
    parser.add_argument("--dtype", default="float32", help="torch dtype name (default float32)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before every rank is killed")
    parser.add_argument("--json", help="write the records (a JSON list) here")
    parser.add_argument("--markdown", help="write the report (machine, command, table) here")


def _validate(args: argparse.Namespace) -> tuple[ClusterSpec, list[int], list[str], list[str]]:
    spec = cluster_spec(args, pin_nodes=args.pin_nodes)  # with --nodes > 1 the bound is the link's rate
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("--iters must be >= 1 and --warmup >= 0")
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        raise SystemExit(f"--dtype {args.dtype!r} is not a torch dtype name")
    ops, impls = args.ops.split(","), args.impls.split(",")
    if bad := [o for o in ops if o not in OPS]:
        raise SystemExit(f"unknown op(s) {bad}; choose from {', '.join(OPS)}")
    if "stock" not in impls or not set(impls) <= set(IMPLS):
        raise SystemExit("--impls must list stock (the reference), optionally with slipstream and/or deepspeed")
    if "slipstream" in impls:
        try:
            from slipstream.core_comm import Communicator  # noqa: F401
        except ImportError as e:
            raise SystemExit(f"slipstream's Communicator is not importable ({e}); use --impls stock") from e
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    except ValueError as e:
        raise SystemExit(str(e)) from e
    return spec, sizes, ops, impls


def memory_bandwidth(nbytes: int = 512 << 20, repeats: int = 10) -> float:
    """Copy bandwidth in bytes/s (bytes read + bytes written) on all cores, best of ``repeats``.

    512 MiB: past the last-level cache (32 MiB on the EPYC of benchmarks/results, 300 MiB on the
    Xeon it first ran on), so this is DRAM; buffers that fit in cache can beat the bound it gives.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        src = torch.ones(nbytes // 4)
        dst = torch.zeros_like(src)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * nbytes / best


def _records(raw: dict, spec: ClusterSpec, mem_bw: float, args: argparse.Namespace) -> list[dict]:
    n, nodes = raw["world_size"], spec.nodes
    out = []
    for r in raw["records"]:
        op, size = r["op"], r["size_bytes"]
        t = statistics.median(r["times_s"])
        if nodes > 1:
            bound = _BUS_FACTOR[op](nodes) * size * 8 / parse_rate(args.link)
        else:
            bound = _MEMORY_BYTES[op](n) * size / mem_bw
        out.append(dict(op=op, size_bytes=size, impl=r["impl"], algorithm=r["algorithm"], backend=raw["backend"],
                        dtype=args.dtype, world_size=n, nodes=nodes, link=args.link if nodes > 1 else None,
                        time_s=t, algbw_gbps=size / t / 1e9, busbw_gbps=size / t / 1e9 * _BUS_FACTOR[op](n),
                        bound_s=bound, times_s=r["times_s"]))
    stock = {(r["op"], r["size_bytes"]): r["time_s"] for r in out if r["impl"] == "stock"}
    for r in out:
        r["vs_stock"] = stock[(r["op"], r["size_bytes"])] / r["time_s"]  # > 1: faster than stock
    return out


def _table(records: list[dict]) -> list[str]:
    rows = [[r["op"], format_size(r["size_bytes"]), f"{r['impl']} ({r['algorithm']})", f"{r['time_s'] * 1e6:.1f}",
             f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}", f"{r['bound_s'] * 1e6:.1f}",
             f"{r['bound_s'] / r['time_s']:.0%}", "" if r["impl"] == "stock" else f"{r['vs_stock']:.2f}x"]
            for r in records]
    return table(["op", "size", "impl", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "bound (us)", "of bound",
                  "vs stock"], "lrlrrrrrr", rows)


def _peer_line(ds) -> str | None:
    """One line on DeepSpeed's shm allreduce: why it is absent, or what it is and cost to set up."""
    if ds is None:
        return None
    if ds.reason:
        return f"deepspeed: absent: {ds.reason}"
    return (f"deepspeed: DeepSpeed {ds.version}'s CPU shm allreduce (allreduce only, SUM, whole world, one node); "
            f"import + JIT build or cached load {ds.setup_s:.1f} s, before the ranks started, not in the timings")


def _deepspeed_peer(impls: list[str], args: argparse.Namespace, spec: ClusterSpec):
    """Get DeepSpeed's op ready when asked for; drop it from ``impls`` where it cannot run."""
    if "deepspeed" not in impls:
        return None
    from .workers import deepspeed_shm

    ds = deepspeed_shm.prepare(getattr(torch, args.dtype), spec.nodes)
    if ds.reason:
        impls.remove("deepspeed")
    return ds


def _notes(spec: ClusterSpec, dtype: str, mem_bw: float, load: float, peer: str | None) -> list[str]:
    where = (f"{spec.nodes} emulated nodes x {spec.ranks_per_node} ranks, link {spec.link} each way"
             if spec.nodes > 1 else f"1 node x {spec.ranks_per_node} ranks (loopback, no emulation)")
    bound = ("bytes across each node's link / link rate" if spec.nodes > 1
             else f"least memory traffic / copy bandwidth {mem_bw / 1e9:.1f} GB/s")
    return [f"load average (1 min) at start / end: {load:.1f} / {os.getloadavg()[0]:.1f} "
            "(other work on the machine slows every implementation)",
            f"layout: {where}; dtype {dtype}; time = median of the slowest rank; "
            f"vs stock = stock time / this implementation's time; bound = {bound}", *([peer] if peer else [])]


def run(args: argparse.Namespace) -> int:
    spec, sizes, ops, impls = _validate(args)
    load = os.getloadavg()[0]
    command = " ".join(["slipstream bench comm", *flags(args, "nodes", "ranks_per_node", "link", "sizes", "ops",
                                                         "impls", "iters", "warmup", "dtype")])
    mem_bw = memory_bandwidth()
    sys.stdout.write(f"{command}\nmemory copy bandwidth {mem_bw / 1e9:.1f} GB/s\n")
    sys.stdout.flush()
    ds = _deepspeed_peer(impls, args, spec)
    peer = _peer_line(ds)
    if peer:
        sys.stdout.write(peer + "\n")
        sys.stdout.flush()
    argv = ["--ops", ",".join(ops), "--sizes", ",".join(map(str, sizes)), "--impls", ",".join(impls),
            *flags(args, "dtype", "iters", "warmup")]
    raw = launch_worker("slipstream.bench.workers.comm", argv, spec, timeout=args.timeout)
    records = _records(raw, spec, mem_bw, args)
    for r in records:
        if r["impl"] == "deepspeed":
            r["setup_s"] = ds.setup_s  # import + build or load, once, outside time_s
    emit(page(command, _notes(spec, args.dtype, mem_bw, load, peer), _table(records)), records, args)
    return 0
