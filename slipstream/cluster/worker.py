"""The ranks slipstream's commands launch: the life of one (:func:`run_worker`), the
launching side (:func:`launch_worker`, with the cluster options and the :func:`flags` that hand
a command's arguments on), and the measurement every benchmark shares.

A worker module is a body and one call::

    def body(args) -> dict: ...      # on every rank; rank 0's return value is the result

    if __name__ == "__main__":
        run_worker(body, options={"--steps": int})

and a command runs it with ``launch_worker("slipstream.bench.workers.comm", argv, spec)``,
which returns that result. :func:`run_worker` parses ``--out`` and the worker's options, sets torch's threads, joins the
process group, runs the body, has rank 0 write its result as JSON to ``--out``, and ends the
process with :func:`leave`. Benchmarks time calls in turns (:func:`in_turns`), each from a
barrier (:func:`time_from_barrier`), and keep the slowest rank's times (:func:`slowest`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from .emulated import ClusterSpec, launch

__all__ = ["add_cluster_options", "add_flags", "cluster_spec", "cores_per_rank", "flags", "in_turns", "launch_worker",
           "leave", "run_worker", "slowest", "time_from_barrier", "timed_step", "turns"]


def launch_worker(module: str, argv: Sequence[str], spec: ClusterSpec, *, env: Mapping[str, str] | None = None,
                  timeout: float | None = None, out: str | Path | None = None, quiet: bool = False,
                  preload: Sequence[str] = ()) -> Any:
    """Run worker ``module`` (``python -m``, see :func:`run_worker`) with ``argv`` on the ranks
    of ``spec`` (:func:`~slipstream.cluster.launch`); return the result rank 0 wrote to ``out``
    (default: a temporary file). ``quiet``: the ranks' output goes to stderr, not stdout.
    ``preload``: what the ranks import beyond the module's top-level imports, imported once
    per node where the ranks are forked."""
    with (tempfile.TemporaryDirectory(prefix="slipstream-worker-") as tmp,
          contextlib.redirect_stdout(sys.stderr) if quiet else contextlib.nullcontext()):
        path = Path(out) if out is not None else Path(tmp) / "result.json"
        launch(["-m", module, *argv, "--out", str(path)], spec, env=env, timeout=timeout, preload=preload)
        return json.loads(path.read_text())


def add_cluster_options(parser: argparse.ArgumentParser, *, ranks_per_node: int) -> None:
    """``--nodes``, ``--ranks-per-node`` and ``--link``: the cluster a command launches on."""
    parser.add_argument("--nodes", type=int, default=1, help="emulated nodes (default 1; more need root)")
    parser.add_argument("--ranks-per-node", type=int, default=ranks_per_node,
                        help=f"ranks per node (default {ranks_per_node})")
    parser.add_argument("--link", help="tc rate of each node's link, e.g. 1gbit (needed for --nodes > 1)")


def cluster_spec(args: argparse.Namespace, **fields: Any) -> ClusterSpec:
    """The cluster of :func:`add_cluster_options`' arguments, with ``fields``; a bad one exits saying why."""
    if args.nodes > 1 and not args.link:
        raise SystemExit("--nodes > 1 needs --link (e.g. 1gbit)")
    try:
        return ClusterSpec(nodes=args.nodes, ranks_per_node=args.ranks_per_node, link=args.link, **fields)
    except ValueError as e:
        raise SystemExit(str(e)) from e


def flags(args: argparse.Namespace, *names: str) -> list[str]:
    """The command-line arguments that give ``names`` their values in ``args`` (``batch_size``:
    ``["--batch-size", "8"]``; True: the bare switch; None, False and "": nothing)."""
    out: list[str] = []
    for name in names:
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif not (value is None or value is False or value == ""):
            out += [flag, str(value)]
    return out


def add_flags(parser: argparse.ArgumentParser, table: Mapping[str, Any]) -> None:
    """Each ``flag: spec`` of ``table``: a type (a required argument of it), False (a switch),
    None (an optional string) or a default (an optional argument of its type)."""
    for flag, spec in table.items():
        if isinstance(spec, type):
            parser.add_argument(flag, type=spec, required=True)
        elif spec is False:
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=str if spec is None else type(spec), default=spec)


def cores_per_rank() -> int:
    """The machine's cores shared among this node's ranks (``LOCAL_WORLD_SIZE``), at least 1."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def run_worker(body: Callable[[argparse.Namespace], Any], *,
               options: Callable[[argparse.ArgumentParser], None] | Mapping[str, Any] | None = None,
               group: str | Callable[[argparse.Namespace], Any] | None = "gloo",
               threads: int | Callable[[], int] | None = 1,
               destroy_group: bool | Callable[[argparse.Namespace], bool] = True,
               argv: Sequence[str] | None = None) -> None:
    """The whole life of a rank; it never returns.

    ``options`` adds the worker's own arguments to the parser (``--out`` is always there), or
    is their table (:func:`add_flags`).
    ``threads``: torch's intra-op threads, a number or a function giving one (after
    ``OMP_NUM_THREADS`` defaults to 1), or None to keep torch's own. ``group``: the backend
    of the default process group, a function of the arguments that joins it (a stack that
    initialises it itself), or None for a process without one. ``destroy_group`` (or a
    function of the arguments saying so): destroy the group at the end; else the ranks meet
    at a barrier and leave without tearing it down (for an extension that aborts in it)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="rank 0 writes the result here, as JSON")
    if callable(options):
        options(parser)
    elif options:
        add_flags(parser, options)
    args = parser.parse_args(argv)
    if threads is not None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(threads() if callable(threads) else threads)
    if isinstance(group, str):
        dist.init_process_group(group)
    elif group is not None:
        group(args)
    result = body(args)
    if int(os.environ.get("RANK", "0")) == 0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    if dist.is_initialized():
        if destroy_group(args) if callable(destroy_group) else destroy_group:
            dist.destroy_process_group()
        else:
            dist.barrier()
    leave()


def leave(code: int = 0) -> None:
    """End a worker whose results are written: run the exit handlers (our communicators close
    and release their shared memory), flush, and leave without the C++ static destructors.

    torch 2.13's gloo aborts in them ('terminate called without an active exception', SIGABRT)
    in ~1 process exit of 5 with stock DDP or FSDP2 on gloo, after every result is written; the
    launcher would then report a finished job as failed."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def turns(names: Sequence[str], i: int) -> list[str]:
    """``names`` in the order of turn ``i``: rotated by ``i``, so that each goes first in turn
    and a slow spell of a shared machine hits all of them."""
    k = i % len(names)
    return list(names[k:]) + list(names[:k])


def time_from_barrier(call: Callable[[], Any], reps: int = 1) -> float:
    """Seconds per call on this rank, from a barrier of the world to the end of ``reps``
    back-to-back calls of ``call``."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - start) / reps


def timed_step(loss: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer,
               device: torch.device | None = None, repeats: int = 1) -> tuple[float, float]:
    """Wall and process-CPU seconds of a training step (zero the gradients, ``loss().backward()``,
    ``optimizer.step()``): the fastest of ``repeats`` runs, since contention from other processes
    only ever adds time. On a CUDA ``device`` a host sync before and after each run."""
    cuda = device is not None and device.type == "cuda"
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        start, cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        loss().backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - start, time.process_time() - cpu))
    return best


def slowest(times: Mapping[str, Sequence[float]]) -> dict[str, list[float]]:
    """Each entry of every list of ``times`` on the slowest rank (every rank passes lists of
    the same lengths)."""
    return _over_ranks(times, dist.ReduceOp.MAX)


def least(times: Mapping[str, Sequence[float]]) -> dict[str, list[float]]:
    """Each entry of every list of ``times``, the least of any rank. Of a step's time in
    collectives: the last rank to reach a collective waits for no one there, so the least is at
    most what moving the data took; a rank's time above it was spent waiting for slower ranks."""
    return _over_ranks(times, dist.ReduceOp.MIN)


def _over_ranks(times: Mapping[str, Sequence[float]], op) -> dict[str, list[float]]:
    """``times`` reduced entry by entry with ``op`` over the world, in one all-reduce."""
    names = list(times)
    t = torch.tensor([list(times[name]) for name in names], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return {name: t[k].tolist() for k, name in enumerate(names)}


def in_turns(calls: Mapping[str, Callable[[], float]], iters: int, warmup: int = 0,
             after: Callable[[int, dict[str, list[float]]], None] | None = None) -> dict[str, list[float]]:
    """Each of ``calls`` (a function returning the seconds it measured) ``warmup`` times
    untimed, then ``iters`` times in :func:`turns`; ``after(i, times)`` follows iteration ``i``.
    Returns the slowest rank's seconds, per call and iteration."""
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(iters):
        for name in turns(names, i):
            times[name].append(calls[name]())
        if after is not None:
            after(i, times)
    return slowest(times)
