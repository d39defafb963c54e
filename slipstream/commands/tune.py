"""``slipstream tune``: measure the communicator's choices ahead of time, cache and print them.

Ranks are started with ``slipstream.cluster.launch`` (one local node, or
``--nodes`` emulated nodes joined by ``--link``). The cache goes where training runs look
for it (``--cache-dir``, default ``~/.cache/slipstream/tuner``). ``--compare`` then times the
fixed default against the tuned choice on each size (the target: never > 5% slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from slipstream.bench.report import emit, format_size, page, parse_size, table
from slipstream.cluster.worker import add_cluster_options, cluster_spec, flags, launch_worker
from slipstream.plugins.deepspeed.translate import zero_buckets
from slipstream.plugins.fsdp.translate import wrap_policy_kwargs

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cluster_options(parser, ranks_per_node=4)
    parser.add_argument("--budget", type=float, default=10.0, help="seconds of measuring (default 10)")
    parser.add_argument("--dtypes", default="float32", help="comma-separated torch dtype names")
    parser.add_argument("--cache-dir", help="tuner cache (default ~/.cache/slipstream/tuner)")
    parser.add_argument("--force", action="store_true", help="measure even when the cache is valid")
    parser.add_argument("--compare", default="", help="sizes to time default vs tuned, e.g. 4K,64K,1M,16M,64M")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per size for --compare")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before every rank is killed")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--markdown", help="also write the report (machine, command, tables) here")


def _ms(t: float | None) -> str:
    return "" if t is None else f"{t * 1e3:.3f}"


def _choices_table(result: dict) -> list[str]:
    from slipstream.core_comm.tuner import TunedPlan

    plan = TunedPlan.from_json(result["plan"])
    world = result["world_size"]
    rows = []
    for r in plan.rows():
        full = r["nbytes"] * (world if r["kind"] == "all_gather" else 1)
        choice = r["algorithm"] + (f" / {format_size(r['chunk_bytes'])}" if r["chunk_bytes"] else "")
        ratio = f"{r['default_time_s'] / r['time_s']:.2f}x" if r["time_s"] and r["default_time_s"] else ""
        cands = ", ".join(f"{k} {_ms(v)}" for k, v in r["times_s"].items())
        rows.append([r["kind"], format_size(full), r["dtype"], choice, r["source"], _ms(r["time_s"]), r["default"],
                     _ms(r["default_time_s"]), ratio, cands])
    b = plan.buckets
    return table(["op", "size (full buffer)", "dtype", "choice", "source", "time (ms)", "default", "default (ms)",
                  "vs default", "candidates (ms)"], "lrlllrlrrl", rows) + [
        "", f"connections per inter-node peer: {plan.connections}"
        + (f" (8 MiB allreduce ms by count: {', '.join(f'{k}: {_ms(v)}' for k, v in plan.connection_times_s.items())})"
           if plan.connection_times_s else "") + f"; plan {result['source']} "
        f"(tuning took {result['tune_s']:.1f} s)",
        f"buckets: DDP {b.ddp_kwargs()}; DeepSpeed (bf16) {zero_buckets(b)}; FSDP (bf16) {wrap_policy_kwargs(b)}",
    ]


def _compare_table(records: list[dict]) -> list[str]:
    rows = []
    for r in records:
        d, t = statistics.median(r["default_times_s"]), statistics.median(r["tuned_times_s"])
        tuned = r["tuned_algorithm"] + (f" / {format_size(r['tuned_chunk_bytes'])}" if r["tuned_chunk_bytes"] else "")
        rows.append([r["kind"], format_size(r["size_bytes"]), r["default_algorithm"], _ms(d), tuned, _ms(t),
                     f"{t / d:.3f}"])
    worst = max(statistics.median(r["tuned_times_s"]) / statistics.median(r["default_times_s"]) for r in records)
    return table(["op", "size", "default", "default (ms)", "tuned", "tuned (ms)", "tuned / default"], "lrlrlrr",
                 rows) + ["", f"worst tuned / default: {worst:.3f} (target <= 1.05)"]


def run(args: argparse.Namespace) -> int:
    spec = cluster_spec(args)
    try:
        sizes = [parse_size(s) for s in args.compare.split(",")] if args.compare else []
        dtypes = args.dtypes.split(",")
    except ValueError as e:
        raise SystemExit(str(e)) from e
    if bad := [d for d in dtypes if not isinstance(getattr(torch, d, None), torch.dtype)]:
        raise SystemExit(f"not torch dtype names: {bad}")
    argv = [*flags(args, "budget", "dtypes", "iters", "force"), "--compare", ",".join(map(str, sizes))]
    argv += ["--cache-dir", os.path.abspath(args.cache_dir)] if args.cache_dir else []
    result = launch_worker("slipstream.commands._tune_worker", argv, spec, timeout=args.timeout, quiet=args.json)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    command = " ".join(["slipstream tune", *flags(args, "nodes", "ranks_per_node", "link"),
                        f"--budget {args.budget:g}", *flags(args, "dtypes", "force", "compare"),
                        *(flags(args, "iters") if args.compare else [])])
    layout = f"layout: {spec.nodes} node(s) x {spec.ranks_per_node} ranks"
    layout += f", link {spec.link}" if spec.link else ""
    layout += f"; fast paths off: {result['unavailable']}" if result["unavailable"] else ""
    body = _choices_table(result) + (["", *_compare_table(result["compare"])] if result["compare"] else [])
    emit(page(command, [layout], body), result, args)
    return 0
