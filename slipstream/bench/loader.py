"""``slipstream bench loader``: how much collation time ``AsyncLoader`` hides behind the step.

One process. A step is a matmul loop calibrated to ``--step-ms``; collating a batch is Python
work (building and padding token lists into tensors, like a tokenising collator) calibrated
to ``--collate-ms``. The same loop runs plainly (collation on the loop's thread, then the step),
through ``AsyncLoader`` (collation on its thread while the step runs) and through
``AsyncLoader(process=True)`` (collation in a child process), in turns, over ``--repeats``
rounds (the order rotates each round). Hidden = (plain time - its time) / the collation time of
the plain run, per round; the report gives the medians. ``--threads`` sets torch's intra-op threads for
the step (default: torch's own, every core: then the step and the collation share the cores).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from slipstream.cluster.worker import flags, turns
from .report import emit, page, table

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=40, help="steps per loop (default 40)")
    parser.add_argument("--step-ms", type=float, default=50.0, help="compute per step (default 50 ms)")
    parser.add_argument("--collate-ms", type=float, default=5.0, help="collation per batch (default 5 ms)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of plain + async (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for the step (default: torch's)")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--markdown", help="write the report here")


def _step_fn(ms: float):
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def once() -> None:
        torch.mm(a, b)

    reps = _calibrate(once, ms)
    return lambda: [once() for _ in range(reps)]


def _collate_fn(ms: float):
    rng = random.Random(0)
    samples = [[rng.randrange(32000) for _ in range(rng.randrange(20, 200))] for _ in range(64)]

    def once():
        longest = max(len(s) for s in samples)
        rows = [s + [0] * (longest - len(s)) for s in samples]
        return torch.tensor(rows)

    reps = _calibrate(once, ms)

    def collate(i: int):
        for _ in range(reps - 1):
            once()
        batch = once()
        batch[0, 0] = i  # each batch its own, so a loop that drops or reorders one shows
        return batch

    return collate


def _calibrate(fn, ms: float) -> int:
    """Repetitions of ``fn`` that take about ``ms`` milliseconds on this machine now."""
    fn()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 0.2:
        fn()
        n += 1
    per = (time.perf_counter() - t0) / n
    return max(1, round(ms / 1e3 / per))


class _Collating:
    """A loader whose batches are collated on iteration (as a DataLoader with num_workers=0)."""

    def __init__(self, collate, steps: int) -> None:
        self.collate, self.steps, self.seconds = collate, steps, 0.0

    def __iter__(self):
        for i in range(self.steps):
            t0 = time.perf_counter()
            batch = self.collate(i)
            self.seconds += time.perf_counter() - t0
            yield batch


def _loop(batches, step) -> tuple[float, list[float]]:
    """The loop's seconds and each batch's sum, in the order the loop got them."""
    sums, t0 = [], time.perf_counter()
    for batch in batches:
        step()
        sums.append(float(batch.sum()))
    return time.perf_counter() - t0, sums


def run(args: argparse.Namespace) -> int:
    from ..data import AsyncLoader

    if args.steps < 1 or args.repeats < 1 or args.step_ms <= 0 or args.collate_ms < 0:
        raise SystemExit("--steps and --repeats must be >= 1, --step-ms > 0, --collate-ms >= 0")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    names = ("steps", "step_ms", "collate_ms", "repeats", "threads")
    command = " ".join(["slipstream bench loader", *flags(args, *names)])
    sys.stdout.write(command + "\n")
    step, collate = _step_fn(args.step_ms), _collate_fn(args.collate_ms)
    kinds = ("plain", "thread", "process")
    rounds = []
    for r in range(args.repeats):
        times, sums, collated = {}, {}, 0.0
        for kind in turns(kinds, r):
            source = _Collating(collate, args.steps)
            batches = source if kind == "plain" else AsyncLoader(source, process=kind == "process")
            times[kind], sums[kind] = _loop(batches, step)
            if kind == "plain":
                collated = source.seconds
        hidden = {k: (times["plain"] - times[k]) / collated if collated else float("nan") for k in kinds[1:]}
        rounds.append({"plain_s": times["plain"], "async_s": times["thread"], "process_s": times["process"],
                       "collate_s": collated, "hidden": hidden["thread"], "hidden_process": hidden["process"],
                       "same_batches": sums["thread"] == sums["plain"] == sums["process"]})
    record = {"steps": args.steps, "step_ms": args.step_ms, "collate_ms": args.collate_ms,
              "threads": torch.get_num_threads(), "rounds": rounds,
              "hidden_median": statistics.median(r["hidden"] for r in rounds),
              "hidden_process_median": statistics.median(r["hidden_process"] for r in rounds)}
    rows = [[i, *(f"{r[k]:.3f}" for k in ("plain_s", "async_s", "process_s", "collate_s")),
             f"{100 * r['hidden']:.0f}%", f"{100 * r['hidden_process']:.0f}%"] for i, r in enumerate(rounds, 1)]
    body = table(["round", "plain (s)", "thread (s)", "process (s)", "collation (s)", "hidden: thread",
                  "hidden: process"], "rrrrrrr", rows)
    body += ["", f"median hidden: {100 * record['hidden_median']:.0f}% of the collation time with a thread, "
                 f"{100 * record['hidden_process_median']:.0f}% with a process"]
    notes = [f"torch threads for the step: {record['threads']}; hidden = (plain - loop) / collation time"]
    emit(page(command, notes, body), record, args)
    return 0
