"""``slipstream env``: the detected topology, backend, which fast paths are active and why the
others are not, the tuned choices (from the cache, else the cost model) and versions.

Ranks are started with ``slipstream.cluster.launch`` like ``slipstream bench comm``
(``--nodes``, ``--ranks-per-node``, ``--link``). Versions of the optional stacks are read from
their installed metadata, without importing them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import slipstream
from slipstream.bench.report import format_size, version
from slipstream.cluster.worker import add_cluster_options, cluster_spec, launch_worker

__all__ = ["add_arguments", "run", "versions"]

_OPTIONAL = ("deepspeed", "transformers", "accelerate", "megatron-core")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cluster_options(parser, ranks_per_node=2)
    parser.add_argument("--cache-dir", help="tuner cache (default ~/.cache/slipstream/tuner)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before every rank is killed")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--clean", action="store_true",
                        help="only remove the shared-memory segments of dead slipstream processes "
                             "(this user's, named slipstream-<pid>-..., creator gone) and list them")


def versions() -> dict[str, str | None]:
    """Python, torch, slipstream and the optional stacks (None: not installed)."""
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "slipstream": slipstream.__version__,
            **{name: version(name) for name in _OPTIONAL}}


def _choice_ranges(choices: list[dict], world: int) -> list[tuple[str, str]]:
    """Per collective, runs of sizes (full buffers) with the same choice: '4 KiB-64 KiB stock; ...'."""
    out: dict[str, list] = {}
    for c in choices:
        if c["dtype"] not in ("any", "float32"):
            continue
        full = c["nbytes"] * (world if c["kind"] == "all_gather" else 1)
        name = c["algorithm"] + (f"/{format_size(c['chunk_bytes'])}" if c["chunk_bytes"] else "")
        runs = out.setdefault(c["kind"], [])
        if runs and runs[-1][2] == name:
            runs[-1][1] = full
        else:
            runs.append([full, full, name])
    return [(kind, "; ".join(f"{format_size(lo)}-{format_size(hi)} {name}" if lo != hi else f"{format_size(lo)} {name}"
                             for lo, hi, name in runs)) for kind, runs in out.items()]


def _text(r: dict) -> str:
    t, fp, tuned = r["topology"], r["fast_paths"], r["tuned"]
    lines = [f"this machine, probed by {r['world_size']} ranks of slipstream env's own (not your job: "
             "slipstream.status() in a job says what slipstream does there)",
             f"probe group: backend {r['backend']} with slipstream's communicator over it; "
             f"{t['num_nodes']} node(s) of {t['node_sizes']} ranks (node of each rank {t['node_of']})",
             f"start-up hook: {r.get('autoload', '?')}", "fast paths of the communicator:"]
    for name, p in fp.items():
        state = "active" if p["active"] else f"off: {p['why_not']}"
        lines.append(f"  {name:<17} {state}")
    lines.append("routes (float32, SUM; built-in rules -> with the tuned plan):")
    for x in r["routes"]:
        why = f" ({x['reason']})" if x["reason"] else ""
        chunk = f"/{format_size(x['tuned_chunk_bytes'])}" if x["tuned_chunk_bytes"] else ""
        lines.append(f"  {x['kind']:<15} {format_size(x['size_bytes']):>8}: {x['algorithm']}{why} -> "
                     f"{x['tuned_algorithm']}{chunk}" + (f" ({x['tuned_reason']})" if x["tuned_reason"] else ""))
    b = tuned["buckets"]
    cache = tuned["cache_file"] if os.path.exists(tuned["cache_file"]) else \
        f"no cache file yet; `slipstream tune` writes {tuned['cache_file']}"
    lines += [f"tuned plan: {tuned['source']} ({cache}), connections {tuned['connections']}"]
    lines += [f"  {kind:<15} {ranges}" for kind, ranges in _choice_ranges(tuned["choices"], r["world_size"])]
    lines += [f"  buckets: DDP {b['ddp']}, DeepSpeed {b['deepspeed']}, FSDP {b['fsdp']}",
              "versions: " + ", ".join(f"{k} {v or '-'}" for k, v in r["versions"].items())]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    if args.clean:
        from slipstream.core_comm.collectives.segment import sweep_stale

        removed = sweep_stale()
        print(f"removed {len(removed)} stale shared-memory segment(s)" + "".join(f"\n  {p}" for p in removed))
        return 0
    spec = cluster_spec(args)
    argv = ["--cache-dir", os.path.abspath(args.cache_dir)] if args.cache_dir else []
    result = launch_worker("slipstream.commands._env_worker", argv, spec, timeout=args.timeout, quiet=args.json)
    result["launch"] = {"nodes": spec.nodes, "ranks_per_node": spec.ranks_per_node, "link": spec.link}
    result["versions"] = versions()
    result["autoload"] = slipstream.status()["autoload"]
    sys.stdout.write(json.dumps(result, indent=1) + "\n" if args.json else _text(result))
    return 0
