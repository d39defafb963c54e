"""``slipstream bench transport``: the inter-node allreduce over K connections vs 1, and gloo.

Runs on ``--nodes`` emulated nodes (root needed) whose links carry ``--link`` each way and cap
every connection on a port of the cluster's ``capped_ports`` at ``--per-connection-rate``, as a
cloud caps single flows. Each rank allreduces ``--size`` bytes of fp32 with its peers on the
other nodes (the inter-node step of the hierarchical path) through ``MultiConnInter`` with
each K of ``--connections``, listening on capped ports, and through gloo (the reference: its
ports are ephemeral, so the per-connection cap does not apply to it). The implementations run
in the same processes, in rotation; each row is the median over ``--iters`` of the slowest
rank's time.

bound: the bytes that must leave each node, 2(N-1)/N x S per rank x ranks per node, divided by
the rate its connections can get: min(link, ranks per node x K x per-connection rate) for
``MultiConnInter``, the link for gloo. TCP's goodput is at most 95.6% of a rate
(``cluster/emulated.py``), so ~96% of bound is the ceiling.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from slipstream.cluster import ClusterSpec, parse_rate
from slipstream.cluster.worker import flags, launch_worker
from .report import emit, format_size, page, parse_size, table

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2; root needed)")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="ranks per node (default 1)")
    parser.add_argument("--link", default="1gbit", help="tc rate of each node's link (default 1gbit)")
    parser.add_argument("--per-connection-rate", default="250mbit",
                        help="cap of each connection on a capped port (default 250mbit, a quarter of 1gbit)")
    parser.add_argument("--size", default="64M", help="allreduce bytes per rank, fp32 (default 64M)")
    parser.add_argument("--connections", default="1,4", help="comma-separated K to compare (default 1,4)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per impl (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations per impl first (default 1)")
    parser.add_argument("--port-base", type=int, default=20000,
                        help="first listening port; all must lie in the capped range 20000-20063 (default 20000)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before every rank is killed")
    parser.add_argument("--json", help="write the records (a JSON list) here")
    parser.add_argument("--markdown", help="write the report (machine, command, table) here")


def _validate(args: argparse.Namespace) -> tuple[ClusterSpec, int]:
    if args.nodes < 2:
        raise SystemExit("--nodes must be >= 2: the transport joins nodes")
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("--iters must be >= 1 and --warmup >= 0")
    try:
        counts = [int(k) for k in args.connections.split(",")]
        size = parse_size(args.size)
        spec = ClusterSpec(nodes=args.nodes, ranks_per_node=args.ranks_per_node, link=args.link,
                           per_connection_rate=args.per_connection_rate)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    if not all(1 <= k <= 16 for k in counts) or size % 4:
        raise SystemExit("--connections must be 1-16 each and --size a multiple of 4 bytes")
    used = range(args.port_base, args.port_base + spec.world_size * sum(counts))
    if used.start < spec.capped_ports.start or used.stop > spec.capped_ports.stop:
        raise SystemExit(f"the transports listen on ports {used.start}-{used.stop - 1}, outside the capped "
                         f"range {spec.capped_ports.start}-{spec.capped_ports.stop - 1}: lower --port-base, "
                         "--connections or the rank count")
    return spec, size


def _records(raw: dict, spec: ClusterSpec) -> list[dict]:
    nodes, per_node, size = spec.nodes, raw["ranks_per_node"], raw["size_bytes"]
    link, per_conn = parse_rate(spec.link), parse_rate(spec.per_connection_rate)
    out = []
    for impl, times in raw["times_s"].items():
        k = None if impl == "gloo" else int(impl.split("=")[1])
        rate = link if k is None else min(link, per_node * k * per_conn)
        t = statistics.median(times)
        out.append(dict(impl=impl, connections=k, size_bytes=size, nodes=nodes, ranks_per_node=per_node,
                        link=spec.link, per_connection_rate=spec.per_connection_rate, time_s=t,
                        link_gbitps=2 * (nodes - 1) / nodes * size * per_node * 8 / t / 1e9,
                        bound_s=2 * (nodes - 1) / nodes * size * per_node * 8 / rate, times_s=times))
    return out


def _table(records: list[dict]) -> list[str]:
    base = next((r["time_s"] for r in records if r["connections"] == 1), None)
    rows = [["gloo (uncapped ports)" if r["impl"] == "gloo" else f"MultiConnInter {r['impl']}",
             f"{r['time_s'] * 1e3:.4g}", f"{r['link_gbitps']:.3f}", f"{r['bound_s'] * 1e3:.4g}",
             f"{r['bound_s'] / r['time_s']:.0%}", f"{base / r['time_s']:.2f}x" if base else ""] for r in records]
    return table(["impl", "time (ms)", "on the link (Gbit/s)", "bound (ms)", "of bound", "vs K=1"], "lrrrrr", rows)


def run(args: argparse.Namespace) -> int:
    spec, size = _validate(args)
    argv = flags(args, "connections", "iters", "warmup", "port_base")
    command = " ".join(["slipstream bench transport", *flags(args, "nodes", "ranks_per_node", "link",
                                                              "per_connection_rate", "size"), *argv])
    sys.stdout.write(command + "\n")
    sys.stdout.flush()
    raw = launch_worker("slipstream.bench.workers.transport", ["--size", str(size), *argv], spec,
                        env={"OMP_NUM_THREADS": "1"}, timeout=args.timeout)
    records = _records(raw, spec)
    notes = [f"layout: {spec.nodes} emulated nodes x {spec.ranks_per_node} ranks, link {spec.link} each way, "
             f"{spec.per_connection_rate} per connection on capped ports; allreduce of {format_size(size)} "
             "fp32 per rank among its peers on the other nodes; time = median of the slowest rank; "
             "on the link = bytes out of each node / time; bound = those bytes / the rate the connections can get"]
    emit(page(command, notes, _table(records)), records, args)
    return 0
