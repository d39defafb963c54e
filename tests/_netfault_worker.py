"""One rank of a network-fault case (``test_netfaults.py``) on the emulated cluster.

Usage: ``_netfault_worker.py DIR [STACK]``, with torchrun's variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``...) set by the harness. Through the slipstream backend, the rank loops rounds
until every rank has seen ``DIR/stop`` (agreed by a MAX all-reduce each round) or ``LIMIT_S``
has passed. A round is, without ``STACK``, an all-reduce, a reduce-scatter and an all-gather
of integer-valued float32 tensors, each result checked against the one computed here (exact:
integer values); with ``STACK`` (``_stack_steps.STACKS``), one training step of that stack,
its loss recorded. ``NETFAULT_ROUNDS`` caps the rounds, ``NETFAULT_PACE_S`` makes each take
at least that long (a sleep, so a fault lands among a known number of rounds). The rank
touches ``DIR/ready<rank>`` after its first round and writes ``DIR/rank<rank>.json``: the
rounds done, the results that differed, the losses, the slowest call or step, and the slowest
round (its calls or step and the agreement to go on: a stall lands in one or the other). A collective
that raises prints ``RAISED <unix time>`` and ``ERROR <type>: <message>`` and exits 1.
"""

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import slipstream
from _stack_steps import make_step

N = 1 << 20  # 4 MiB of float32 a call: across nodes, the hierarchical path
LIMIT_S = 120.0


def _round(i: int, rank: int, world: int, base: torch.Tensor) -> tuple[list[str], float]:
    """One call of each kind; the names of the results that differ, the slowest call's time."""
    def mine(r: int) -> torch.Tensor:
        return base + (r + 1) * (i % 7 + 1)

    total = world * base + sum((r + 1) * (i % 7 + 1) for r in range(world))
    chunk = N // world
    summed, scattered, gathered = mine(rank), torch.empty(chunk), torch.empty(N * world)
    wrong, slowest = [], 0.0
    for name, call, args, result, expected in (
        ("all_reduce", dist.all_reduce, (summed,), summed, total),
        ("reduce_scatter", dist.reduce_scatter_tensor, (scattered, mine(rank)), scattered,
         total[rank * chunk:(rank + 1) * chunk]),
        ("all_gather", dist.all_gather_into_tensor, (gathered, mine(rank)), gathered,
         torch.cat([mine(r) for r in range(world)])),
    ):
        started = time.perf_counter()
        call(*args)
        slowest = max(slowest, time.perf_counter() - started)
        if not torch.equal(result, expected):
            wrong.append(f"round {i} {name}")
    return wrong, slowest


def _collectives(rank: int, world: int):
    base = (torch.arange(N) % 251).float()
    return lambda i: _round(i, rank, world, base)


def _training(stack: str):
    """A round: one step of ``stack``; nothing to check here (the harness compares losses)."""
    step = make_step(stack)

    def round_(i: int) -> tuple[list[str], float, float]:
        started = time.perf_counter()
        loss = step(i)
        return [], time.perf_counter() - started, loss

    return round_


def main(out: Path, stack: str | None) -> int:
    slipstream.enable()
    dist.init_process_group("slipstream", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    record = {"rank": rank, "rounds": 0, "wrong": [], "slowest_s": 0.0, "slowest_round_s": 0.0, "losses": []}
    deadline = time.time() + LIMIT_S
    rounds, pace = int(os.environ.get("NETFAULT_ROUNDS", "0")), float(os.environ.get("NETFAULT_PACE_S", "0"))
    try:
        round_ = _collectives(rank, world) if stack is None else _training(stack)
        while True:
            started = time.perf_counter()
            wrong, slowest, *loss = round_(record["rounds"])
            record["rounds"] += 1
            record["wrong"] += wrong
            record["losses"] += loss
            record["slowest_s"] = max(record["slowest_s"], slowest)
            if record["rounds"] == 1:
                (out / f"ready{rank}").touch()
            done = record["rounds"] == rounds or (out / "stop").exists() or time.time() > deadline
            stop = torch.tensor([float(done)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            took = time.perf_counter() - started  # the calls or the step, and the agreement to go on
            record["slowest_round_s"] = max(record["slowest_round_s"], took)
            if stop.item():
                break
            time.sleep(max(0.0, pace - took))
    except Exception as e:  # noqa: BLE001 - reported to the harness
        traceback.print_exc()
        print(f"RAISED {time.time():.3f}", flush=True)
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
        sys.exit(1)
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None))
