"""``slipstream bench soak``: thousands of mixed collectives and hundreds of groups, checked
against gloo, with the ranks' resources watched.

One row per layout (``--layouts``, default ``1x4,2x2@1gbit``: one node of 4 ranks, then 2
emulated nodes x 2 ranks over a 1 Gbit/s link, root needed), and a reference row. Each rank
runs ``--collectives`` calls of random kind, reduction, dtype, group (the world, its halves,
its even and odd ranks) and size (0 B to ``--max-bytes``), then makes, uses and destroys
``--groups`` subgroups (``workers/soak.py``): first in a job on gloo alone, the reference,
then in a job on the slipstream backend with the same draws and inputs. The two jobs' results
are compared call by call, rank by rank (a CRC-32 of each result's bytes). Gloo runs in a
process of its own, so slipstream's rows count what its calls do to the process and nothing
that gloo's do (``benchmarks/results/faults_*.md``). Reported per job: results that differed
from gloo's, group cycles that gave a wrong sum, and the largest rank's resident memory (less
the soak's own input and result buffers, made and written before the first reading: the
calls' tensors are views of them), descriptors and threads (and the shared-memory segments
named by the job's ranks) at the start, after the 1,000th call, half-way, at the end of the
calls and after the group cycles.
It exits 1 when a result differed, memory grew 5% or more from the 1,000th call to the end, or
descriptors, threads or segments changed from the 1,000th call to the end or over the group
cycles, in slipstream's job; the reference's verdict is shown, and does not count. ``--trim``
reads the memory once the C allocator has returned its free memory (glibc's ``malloc_trim``):
what the ranks use rather than what glibc keeps in its heaps after freeing large tensors. The
report names the C allocator's settings the ranks inherit from the environment (``MALLOC_*``,
``GLIBC_TUNABLES``, ``LD_PRELOAD``): glibc's default mmap threshold adapts to the sizes freed,
so a mix of sizes grows the heap (``benchmarks/results/faults_*.md``).
"""

from __future__ import annotations

import argparse
import os
import random
import sys

from slipstream.cluster.worker import flags, launch_worker
from .ddp import parse_layout
from .report import emit, page, parse_size, table
from .workers.soak import describe, draw, members

__all__ = ["add_arguments", "run", "verdict"]

RSS_GROWTH = 0.05
"""Largest growth of a rank's resident memory from the 1,000th call to the last that passes."""
_MOMENTS = ("start", "after_1000", "middle", "end", "after_groups")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layouts", default="1x4,2x2@1gbit",
                        help="NODESxRANKS[@LINK], comma-separated (default 1x4,2x2@1gbit)")
    parser.add_argument("--collectives", type=int, default=20000, help="calls per layout (default 20000)")
    parser.add_argument("--groups", type=int, default=500, help="subgroup create/destroy cycles (default 500)")
    parser.add_argument("--max-bytes", default="64M", help="largest call (default 64M)")
    parser.add_argument("--seed", type=int, default=0, help="the draws' seed (default 0)")
    parser.add_argument("--trim", action="store_true",
                        help="read memory once the C allocator has returned its free memory (glibc's malloc_trim)")
    parser.add_argument("--timeout", type=float, default=7200, help="seconds before every rank is killed")
    parser.add_argument("--json", help="write the records (a JSON list) here")
    parser.add_argument("--markdown", help="write the report (machine, command, table) here")


def held(snapshot: dict) -> float:
    """A reading's resident memory (MiB) less the soak's own buffers (``workers/soak.py``)."""
    return snapshot["rss_mib"] - snapshot["buffers_mib"]


def _peak(raw: dict, moment: str, field: str) -> float:
    return max(held(r["snapshots"][moment]) if field == "held_mib" else r["snapshots"][moment][field]
               for r in raw["ranks"])


def compare(reference: dict, ours: dict, seed: int, max_bytes: int) -> list[str]:
    """The calls whose result on some rank differed from the reference's (its checksum), each
    named by its place in the sequence, its draw and the ranks."""
    theirs = {r["rank"]: r["checksums"] for r in reference["ranks"]}
    ranks: dict[int, list[int]] = {}
    for r in ours["ranks"]:
        for i, (a, b) in enumerate(zip(r["checksums"], theirs[r["rank"]], strict=True)):
            if a != b:
                ranks.setdefault(i, []).append(r["rank"])
    rng, groups, named = random.Random(seed), members(ours["world_size"]), []
    for i in range(max(ranks, default=-1) + 1):  # the same draws as the ranks'
        call = draw(rng, groups, max_bytes)
        if i in ranks:
            named.append(f"call {i}: {describe(call)}, ranks {ranks[i]}")
    return named


def verdict(raw: dict, differ: list[str] = ()) -> list[str]:
    """What failed in one job: results that differed from the reference's (``differ``), a wrong
    group sum, memory growth of ``RSS_GROWTH`` or more on any rank, or descriptors, threads or
    segments that changed, from the 1,000th call to the end or over the group cycles."""
    failed = []
    if differ:
        failed.append(f"{len(differ)} results differ from gloo's, e.g. {list(differ[:3])}")
    if any(r["cycles_wrong"] for r in raw["ranks"]):
        failed.append("a subgroup made and destroyed in the cycles gave a wrong sum")
    for r in raw["ranks"]:
        before, end, groups = (r["snapshots"][m] for m in ("after_1000", "end", "after_groups"))
        if held(end) >= (1 + RSS_GROWTH) * held(before):
            failed.append(f"rank {r['rank']}: memory grew {held(before):.0f} -> {held(end):.0f} MiB")
        for field in ("fds", "threads", "segments"):
            if end[field] != before[field]:
                failed.append(f"rank {r['rank']}: {field} {before[field]} -> {end[field]}")
            if groups[field] != end[field]:
                failed.append(f"rank {r['rank']}: {field} {end[field]} -> {groups[field]} over the group cycles")
    return failed


def _record(layout: str, raw: dict, reference: bool = False, differ: list[str] = ()) -> dict:
    ranks = [{k: v for k, v in r.items() if k != "checksums"} for r in raw["ranks"]]
    return {"layout": layout + " (reference: gloo alone)" * reference, "reference": reference,
            **{k: raw[k] for k in ("world_size", "collectives", "group_cycles", "calls_s")},
            "differ": None if reference else len(differ), "differ_calls": list(differ[:20]),
            "cycles_wrong": sum(r["cycles_wrong"] for r in raw["ranks"]),
            "peak": {m: {f: _peak(raw, m, f) for f in ("held_mib", "rss_mib", "fds", "threads", "segments")}
                     for m in _MOMENTS},
            "failed": verdict(raw, differ), "ranks": ranks, "rss_growth": _growth(raw)}


def _growth(raw: dict) -> list[float]:
    """Each rank's memory (less the soak's buffers) at the end of the calls over that at the 1,000th, minus 1."""
    return [held(r["snapshots"]["end"]) / held(r["snapshots"]["after_1000"]) - 1 for r in raw["ranks"]]


def _table(records: list[dict]) -> list[str]:
    rows = []
    for r in records:
        peak = r["peak"]
        rows.append([r["layout"], r["collectives"], f"{r['calls_s']:.0f}", "-" if r["reference"] else r["differ"],
                     f"{r['group_cycles']} ({r['cycles_wrong']} wrong)",
                     " / ".join(f"{peak[m]['held_mib']:.0f}" for m in _MOMENTS),
                     " / ".join(f"{g:+.0%}" for g in r["rss_growth"]),
                     *(" / ".join(str(peak[m][f]) for m in _MOMENTS) for f in ("fds", "threads", "segments")),
                     "reference: " * r["reference"] + ("FAIL: " + "; ".join(r["failed"]) if r["failed"] else "pass")])
    return table(["layout", "collectives", "calls (s)", "results differing from gloo's", "group cycles",
                  "RSS MiB less the soak's buffers (start / 1,000th / middle / end / after groups)",
                  "RSS growth per rank, 1,000th to end",
                  "descriptors", "threads", "shm segments", "verdict"], "lrrrlllllll", rows)


def allocator_env() -> dict[str, str]:
    """The C allocator's settings in the environment the ranks inherit."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "LD_PRELOAD")}


def run(args: argparse.Namespace) -> int:
    try:
        layouts = [(text, parse_layout(text)) for text in args.layouts.split(",")]
        max_bytes = parse_size(args.max_bytes)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    if args.collectives < 1 or args.groups < 0:
        raise SystemExit("--collectives must be >= 1 and --groups >= 0")
    argv = [*flags(args, "collectives", "groups", "seed", "trim"), "--max-bytes", str(max_bytes)]
    env = allocator_env()
    command = " ".join([*(f"{k}={v}" for k, v in env.items()), "slipstream bench soak",
                        *flags(args, "layouts", "max_bytes"), *argv[:-2]])
    sys.stdout.write(command + "\n")
    notes = ["each call run in a job on gloo alone (the reference row), then in a job on the slipstream backend, "
             "with the same integer-valued inputs; results compared call by call and rank by rank (CRC-32 of "
             "their bytes)",
             "each call's input and result are views of two buffers per rank (--max-bytes, and --max-bytes times "
             "the world), made and written before the first reading; memory: the resident memory less those buffers",
             "resources: the largest rank's (segments: those named by the job's ranks); verdict: no result "
             f"differing, growth of that memory < {RSS_GROWTH:.0%} from the 1,000th call to the end, descriptors, "
             "threads and segments unchanged over that span and over the group cycles; the reference's does "
             "not count"]
    notes.append(f"C allocator settings from the environment: {' '.join(f'{k}={v}' for k, v in env.items())}" if env
                 else "C allocator: glibc's defaults (its mmap threshold rises, up to 32 MiB, to each mapped block "
                 "freed: later blocks up to that size come from the heap)")
    if args.trim:
        notes.append("memory read once the C allocator had returned its free memory (malloc_trim): what the ranks "
                     "use, not what glibc keeps in its heaps for later")
    records, runs = [], 2 * len(layouts)
    for text, spec in layouts:
        reference = launch_worker("slipstream.bench.workers.soak", argv + ["--reference"], spec, timeout=args.timeout)
        records.append(_record(text, reference, reference=True))
        _partial(command, notes, records, runs, args)
        ours = launch_worker("slipstream.bench.workers.soak", argv, spec, timeout=args.timeout)
        records.append(_record(text, ours, differ=compare(reference, ours, args.seed, max_bytes)))
        _partial(command, notes, records, runs, args)
    emit(page(command, notes, _table(records)), records, args)
    return 0 if not any(r["failed"] for r in records if not r["reference"]) else 1


def _partial(command: str, notes: list[str], records: list[dict], runs: int, args: argparse.Namespace) -> None:
    """The runs done are kept, should a later one be stopped."""
    if len(records) < runs:
        emit(page(command, [*notes, f"partial: {len(records)} of {runs} runs done"], _table(records)), records, args,
             show=False)
