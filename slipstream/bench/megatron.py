"""``slipstream bench megatron``: megatron-core GPT training, gloo vs slipstream, padded vs packed.

For each ``--tp`` (default ``2,1``: TP=2 inside each node x DP across nodes, then TP=1 x DP
over every rank) on one cluster layout (default 2 emulated nodes x 2 ranks over 1 Gbit/s, root
needed), three jobs run one after another on the same data and seed (``workers/megatron.py``):
gloo with padded batches (stock), slipstream with padded batches, slipstream with packed (THD)
batches through its packed attention. Megatron's DDP reduces the gradients; the optimizer is
torch's AdamW over DDP's reduced gradients. Slipstream's jobs turn it on as a user does
(``slipstream.enable()``), so its defaults hold: under ``"overlap": "auto"`` their first steps
trial Megatron's bucket all-reduces during backward against blocking (the notes say what each
chose; ``SLIPSTREAM_OVERLAP_DIR`` keeps the choice for the next run).

Columns: the median step time of the slowest rank; ratio = gloo padded / this job (> 1 is
faster); loss: the largest per-step relative difference from gloo padded; for slipstream's
jobs, the median time in collectives (some call in flight), the least of any rank (what moving
took at most: the rank that arrives last waits for no one) and its exposed part (a caller
waiting), from the core's timeline, and the link bound (the bytes it sent out of a node per
step at the link's rate). ``--no-varlen`` leaves out the packed job: collectives only;
``--wire bf16|int8`` sends slipstream's gradients across the nodes in that lossy format;
``--overlap`` turns on Megatron DDP's ``overlap_grad_reduce`` in every job (buckets of
``--bucket`` elements all-reduced asynchronously during backward, on gloo's threads or the
core's). What
megatron-core needs CUDA for on CPU is worked around in the ranks only, and listed in the
report.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from slipstream.cluster import parse_rate
from slipstream.cluster.worker import flags, launch_worker
from slipstream.core_comm.config import WIRE_FORMATS
from .ddp import parse_layout
from .report import emit, page, table, version

__all__ = ["JOBS", "add_arguments", "run"]

WORKER = "slipstream.bench.workers.megatron"
# What the ranks import besides the worker's top-level imports: about 5 s of CPU a rank on 2 cores
_PRELOAD = ("megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.transformer.transformer_config")
JOBS = (("gloo", False), ("slipstream", False), ("slipstream", True))  # (backend, packed); the first is stock
# --rounding: stock references for the loss differences: the stock job with its sums taken in
# another order (the rounding floor of the padded jobs), and the packed batches on stock
ROUNDING_JOBS = (("gloo", False, True), ("gloo", True, False))  # (backend, packed, reversed sums)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layout", default="2x2@1gbit", help="NODESxRANKS[@LINK] (default 2x2@1gbit)")
    parser.add_argument("--tp", default="2,1", help="tensor-parallel sizes, comma-separated (default 2,1)")
    parser.add_argument("--data", default=None, help="alpaca-format JSON (default: a generated dataset)")
    parser.add_argument("--samples", type=int, default=400, help="samples to generate when --data is not given")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="samples per data-parallel rank per step")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per job (default 8)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--no-varlen", action="store_true", help="padded jobs only (slipstream's collectives)")
    parser.add_argument("--wire", choices=WIRE_FORMATS, default="full",
                        help="slipstream jobs: the cross-node format of the gradients (lossy unless full)")
    parser.add_argument("--overlap", action="store_true",
                        help="every job: Megatron DDP's overlap_grad_reduce (bucket all-reduces during backward)")
    parser.add_argument("--bucket", type=int, default=1_000_000,
                        help="with --overlap: Megatron DDP's bucket size in elements (default 1000000)")
    parser.add_argument("--rounding", action="store_true",
                        help="also run the stock references of the loss differences: gloo padded with its "
                             "data-parallel sums in reversed rank order, and gloo packed")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before every rank is killed")
    parser.add_argument("--json", help="write the records (a JSON list) here")
    parser.add_argument("--markdown", help="write the report (machine, command, table) here")


def _tps(text: str, per_node: int) -> list[int]:
    try:
        tps = [int(t) for t in text.split(",")]
    except ValueError:
        raise SystemExit(f"--tp: comma-separated integers, got {text!r}") from None
    for tp in tps:
        if tp < 1 or per_node % tp:  # then it divides the world too
            raise SystemExit(f"--tp {tp}: must divide the ranks per node ({per_node}); tensor parallelism "
                             "stays inside a node")
    return tps


def _record(layout: str, jobs: list[dict], spec) -> dict:
    stock = jobs[0]
    base = statistics.median(stock["times_s"])
    out = {"layout": layout, "tp": stock["tp"], "dp": stock["dp"], "params": stock["params"], "jobs": []}
    for job in jobs:
        step = statistics.median(job["times_s"])
        diff = _rel_diff(stock["losses"], job["losses"])
        sent = job["link_bytes"] / spec.nodes
        out["jobs"].append({**job, "step_s": step, "ratio": base / step, "max_rel_loss_diff": diff,
                            "comm_med_s": statistics.median(job["comm_s"]),
                            "comm_least_med_s": statistics.median(job["comm_least_s"]),
                            "exposed_med_s": statistics.median(job["exposed_s"]),
                            "link_bound_s": sent * 8 / parse_rate(spec.link) if spec.link and sent else None,
                            "padding_removed": 1 - job["real_tokens"] / job["padded_tokens"] if job["packed"] else 0.0})
    return out


def _job_name(job: dict) -> str:
    return f"{job['backend']} {'packed' if job['packed'] else 'padded'}" + (
        ", sums reversed" if job.get("reversed_sums") else "")


def _table(records: list[dict]) -> list[str]:
    def seconds(job: dict, key: str) -> str:
        return "-" if job["backend"] == "gloo" or job[key] is None else f"{job[key]:.3f}"

    rows = [[r["layout"], f"{r['tp']} x {r['dp']}", f"{r['params'] / 1e6:.1f} M",
             _job_name(j), f"{j['step_s']:.3f}",
             f"{j['ratio']:.2f}x", *(seconds(j, k) for k in ("comm_med_s", "comm_least_med_s", "exposed_med_s",
                                                             "link_bound_s")),
             f"{j['max_rel_loss_diff']:.1e}",
             ", ".join(f"{op}: {'/'.join(sorted(p))}" for op, p in sorted(j["comm_paths"].items())) or "-"]
            for r in records for j in r["jobs"]]
    return table(["layout", "TP x DP", "params", "job", "step (s)", "ratio", "in collectives (s)",
                  "least of any rank (s)", "exposed (s)", "link bound (s)", "loss diff", "fast paths"],
                 "llrlrrrrrrrl", rows)


def _packed_against_stock(record: dict) -> str:
    """The largest per-step relative loss difference of each packed job from gloo packed."""
    packed = [j for j in record["jobs"] if j["packed"]]
    stock = next(j for j in packed if j["backend"] == "gloo")
    return ", ".join(f"TP {record['tp']} {_job_name(j)} {_rel_diff(stock['losses'], j['losses']):.1e}"
                     for j in packed if j is not stock)


def _rel_diff(reference: list[float], losses: list[float]) -> float:
    return max(abs(a - b) / abs(a) for a, b in zip(reference, losses, strict=True))


def run(args: argparse.Namespace) -> int:
    from .._common import lazy
    from .workers.megatron import CPU_WORKAROUNDS

    if not lazy.installed("megatron.core"):
        raise SystemExit("slipstream bench megatron needs megatron-core: pip install 'slipstream[megatron]'")
    try:
        spec = parse_layout(args.layout)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    tps = _tps(args.tp, spec.ranks_per_node)
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    if args.rounding and (args.overlap or args.no_varlen):
        raise SystemExit("--rounding: its references run without --overlap and with the packed job (no --no-varlen)")
    if args.bucket < 1:
        raise SystemExit(f"--bucket must be >= 1 element, got {args.bucket}")
    model = flags(args, "max_length", "batch", "steps", "warmup", "hidden", "layers", "heads")
    data = flags(args, "data") or flags(args, "samples")
    overlap = flags(args, "overlap", "bucket") if args.overlap else []
    command = " ".join(["slipstream bench megatron", *flags(args, "layout", "tp", "no_varlen", "wire", "rounding"),
                        *overlap, *data, *model])
    sys.stdout.write(command + "\n")
    records = []
    for tp in tps:
        argv = ["--tp", str(tp), *model, *overlap, *flags(args, "samples", "data")]
        plan = [(backend, packed, False) for backend, packed in JOBS if not (packed and args.no_varlen)]
        jobs = [launch_worker(WORKER, [*argv, "--backend", backend, *["--packed"] * packed,
                                       *["--reversed-sums"] * reverse], spec,
                              env={"SLIPSTREAM_WIRE": args.wire}, timeout=args.timeout, preload=_PRELOAD)
                for backend, packed, reverse in plan + list(ROUNDING_JOBS) * args.rounding]
        records.append(_record(args.layout, jobs, spec))
    notes = ["step: median step time of the slowest rank; ratio = gloo padded step / this step; loss diff: "
             "largest per-step relative difference from gloo padded",
             *(["rounding: 'gloo padded, sums reversed' is stock's own rounding floor for the padded jobs; "
                "packed jobs against gloo packed: " + "; ".join(_packed_against_stock(r) for r in records)]
               if args.rounding else []),
             *(f"overlap, TP={r['tp']} {_job_name(j)}: {j['overlap_choice']}" for r in records for j in r["jobs"]
               if j.get("overlap_choice")),
             "worked around in the ranks (megatron-core on CPU): " + "; ".join(CPU_WORKAROUNDS)]
    extra = f"megatron-core {version('megatron-core') or 'not installed'}"
    emit(page(command, notes, _table(records), extra), records, args)
    return 0
