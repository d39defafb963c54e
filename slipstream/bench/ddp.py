"""``slipstream bench ddp``: DDP training, ``init_process_group("slipstream")`` vs gloo.

One row per layout (``--layouts``, default ``2x2@1gbit,1x4``: 2 emulated nodes x 2 ranks over a
1 Gbit/s link, root needed; then 1 node x 4 ranks on loopback). In each, every rank trains two
copies of one MLP with plain ``DistributedDataParallel``, one on the slipstream default group
and one on a gloo group of the same ranks, a step of each in turn (``workers/ddp.py``).

Columns: steps/s from the median step time of the slowest rank; ratio = slipstream / gloo
steps/s; weights: both models' weights after the run, ``allclose`` at fp32 tolerance
(rtol 1.3e-6, atol 1e-5) and the largest difference (a lossy ``--wire`` is compared with
its own stated error instead: see the JSON); link bound: the least time the gradient
allreduce needs on the link, 2(N-1)/N x gradient bytes / link rate (N nodes; TCP gets at most
95.6% of it, see ``cluster/emulated.py``). Where the step's time goes: compute (the same step
without DDP, in the same turns), slipstream's time in collectives (some call in flight, the
core's timeline) and each backend's exposed communication (its step beyond compute).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys

from slipstream.cluster import ClusterSpec, parse_rate
from slipstream.cluster.worker import flags, launch_worker
from slipstream.core_comm.config import WIRE_FORMATS
from .report import emit, page, table

__all__ = ["add_arguments", "parse_layout", "run"]

_LAYOUT = re.compile(r"(\d+)x(\d+)(?:@(\S+))?$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layouts", default="2x2@1gbit,1x4",
                        help="NODESxRANKS[@LINK], comma-separated (default 2x2@1gbit,1x4)")
    parser.add_argument("--width", type=int, default=1024, help="MLP width (default 1024)")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers (default 4: 4.2 M parameters)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step (default 32)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per backend (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb (default 25)")
    parser.add_argument("--wire", choices=WIRE_FORMATS, default="full",
                        help="slipstream's cross-node format of the gradients (lossy unless full)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before every rank is killed")
    parser.add_argument("--json", help="write the records (a JSON list) here")
    parser.add_argument("--markdown", help="write the report (machine, command, table) here")


def parse_layout(text: str) -> ClusterSpec:
    """``"2x2@1gbit"`` -> 2 nodes x 2 ranks, 1 Gbit/s links; ``"1x4"`` -> one node of 4."""
    m = _LAYOUT.match(text.strip())
    if not m:
        raise ValueError(f"not a layout: {text!r} (e.g. 2x2@1gbit, 1x4)")
    return ClusterSpec(nodes=int(m.group(1)), ranks_per_node=int(m.group(2)), link=m.group(3))


def _record(spec: ClusterSpec, layout: str, raw: dict) -> dict:
    med = {b: statistics.median(t) for b, t in raw["times_s"].items()}
    grad_bytes = raw["params"] * 4
    bound = (2 * (spec.nodes - 1) / spec.nodes * grad_bytes * 8 / parse_rate(spec.link)) if spec.link else None
    sent = raw["link_bytes"] / spec.nodes  # out of each node per step, as slipstream moved it
    return dict(layout=layout, nodes=spec.nodes, ranks_per_node=spec.ranks_per_node, link=spec.link,
                params=raw["params"], step_s=med, steps_per_s={b: 1 / t for b, t in med.items() if b != "comm"},
                ratio=med["gloo"] / med["slipstream"], link_bound_s=bound,
                sent_bound_s=sent * 8 / parse_rate(spec.link) if spec.link and sent else None,
                compute_s=med["compute"], comm_s=med["comm"],
                exposed_s={b: max(0.0, med[b] - med["compute"]) for b in ("gloo", "slipstream")},
                weights_allclose=raw["weights_allclose"], weights_equal=raw["weights_equal"],
                max_abs_weight_diff=raw["max_abs_weight_diff"], times_s=raw["times_s"])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def _table(records: list[dict]) -> list[str]:
    rows = []
    for r in records:
        bound = f"{r['link_bound_s'] * 1e3:.0f}" if r["link_bound_s"] else "-"
        same = "equal" if r["weights_equal"] else ("allclose" if r["weights_allclose"] else "DIFFER")
        if r["sent_bound_s"] and r["link_bound_s"] and r["sent_bound_s"] < 0.9 * r["link_bound_s"]:
            bound += f" ({r['sent_bound_s'] * 1e3:.0f} as sent)"
        rows.append([r["layout"], f"{r['params'] / 1e6:.1f} M", f"{r['steps_per_s']['gloo']:.2f}",
                     f"{r['steps_per_s']['slipstream']:.2f}", f"{r['ratio']:.2f}x", _ms(r["compute_s"]),
                     _ms(r["comm_s"]), f"{_ms(r['exposed_s']['gloo'])} / {_ms(r['exposed_s']['slipstream'])}", bound,
                     f"{same} (max diff {r['max_abs_weight_diff']:.1e})"])
    return table(["layout", "params", "gloo steps/s", "slipstream steps/s", "ratio", "compute (ms)",
                  "slipstream in collectives (ms)", "exposed gloo / slipstream (ms)", "link bound (ms)", "weights"],
                 "lrrrrrrrrl", rows)


def run(args: argparse.Namespace) -> int:
    try:
        layouts = [(text, parse_layout(text)) for text in args.layouts.split(",")]
    except ValueError as e:
        raise SystemExit(str(e)) from e
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    argv = flags(args, "width", "depth", "batch", "steps", "warmup", "bucket_mb")
    command = " ".join(["slipstream bench ddp", *flags(args, "layouts", "wire"), *argv])
    sys.stdout.write(command + "\n")
    env = {"SLIPSTREAM_WIRE": args.wire}
    records = [_record(spec, text, launch_worker("slipstream.bench.workers.ddp", argv, spec, env=env,
                                                 timeout=args.timeout)) for text, spec in layouts]
    notes = ["steps/s from the median step time of the slowest rank; ratio = slipstream / gloo steps/s",
             "compute: the same step without DDP; exposed: a step's time beyond it"]
    if args.wire != "full":
        notes.append(f"slipstream's gradients cross nodes in {args.wire} (lossy): its weights differ from gloo's")
    emit(page(command, notes, _table(records)), records, args)
    return 0 if args.wire != "full" or all(r["weights_allclose"] for r in records) else 1
