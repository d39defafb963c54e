"""One rank of ``slipstream bench soak``.

Every rank draws the same sequence from one seed (:func:`draw`): each call's kind (all-reduce
with SUM, MAX or MIN, reduce-scatter, all-gather), dtype, group (the world, the two halves of
the world, the even and the odd ranks) and size (0 B, else log-uniform from 1 B to
``--max-bytes``). Its members run it on the slipstream backend, or with ``--reference`` on
gloo, with integer-valued inputs (in [-8, 8], so every order of summation gives the same exact
result in every dtype) drawn from a seed of the call and the rank, and keep a CRC-32 of each
result's bytes. The runner compares the two jobs' checksums call by call. Gloo's results are
computed in a process of their own, so this process's resources are those of the calls it
runs: a gloo reference in the same process, under glibc's defaults, grew a rank's resident
memory 6-26% from the 1,000th call to the 4,000th where slipstream's calls alone grew it 0-1%
(``benchmarks/results/faults_*.md``). Then ``--groups`` times a subgroup is made on the job's
backend, used once (checked against the sum computed here) and destroyed.

Every call's input and result are views of two buffers (``--max-bytes``, and ``--max-bytes``
times the world for the results) that the rank makes and writes before the first reading, as a
training job's gradient buckets live across its steps. A rank that made fresh tensors of random
sizes for every call, with no collective at all, grew its resident memory 23% from the 1,000th
call to the 20,000th under glibc's defaults (freed blocks of up to 32 MiB stay in its heaps):
the soak measured its own tensors. The buffers stay resident, at a constant size, and the
readings' memory is the rank's resident memory less theirs.

The rank's resident memory, open file descriptors and threads, and the shared-memory segments
named by the job's ranks (another job's on the machine are not counted), are read at the start,
after the 1,000th call, half-way, at the end of the calls and after the group cycles. With
``--trim`` the C allocator first returns its free memory (glibc keeps freed blocks of up to
32 MiB in its heaps, so the resident memory of a process that frees large tensors of varying
sizes grows without a leak).
"""

from __future__ import annotations

import array
import ctypes
import gc
import math
import os
import random
import re
import time
import zlib

import torch
import torch.distributed as dist

import slipstream  # noqa: F401 - registers the backend
from slipstream.cluster.worker import run_worker
from slipstream.core_comm.collectives.segment import SHM_DIR, creator

KINDS = ("all_reduce", "reduce_scatter", "all_gather")
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64)


def trim_malloc() -> bool:
    """Have the C allocator return its free memory to the system (glibc's ``malloc_trim``);
    False where the C library has no such call."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def usage(trim: bool = False, pids=None) -> dict:
    """This process's resident memory (MiB; of it, anonymous and shared memory), open descriptors
    and threads; the slipstream shared-memory segments named by the processes ``pids`` (None:
    every one on the machine). ``trim``: read once Python's
    cyclic garbage is collected and the C allocator has returned its free memory, so the memory
    is what the process uses, not what the allocator keeps for later."""
    if trim:
        gc.collect()
        if not trim_malloc():
            raise SystemExit("--trim: this C library has no malloc_trim (glibc's)")
    with open("/proc/self/status") as f:
        status = f.read()
    names = os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []
    segments = [n for n in names if (pid := creator(n)) is not None and (pids is None or pid in pids)]
    kib = {k: int(re.search(rf"{k}:\s+(\d+)", status).group(1)) for k in ("VmRSS", "RssAnon", "RssShmem")}
    return {"rss_mib": kib["VmRSS"] / 1024, "anon_mib": kib["RssAnon"] / 1024, "shmem_mib": kib["RssShmem"] / 1024,
            "threads": int(re.search(r"Threads:\s+(\d+)", status).group(1)),
            "fds": len(os.listdir("/proc/self/fd")), "segments": len(segments)}


def members(world: int) -> dict[str, list[int]]:
    """The groups the calls are drawn from, by name: the world first."""
    out = {"world": list(range(world))}
    if world >= 4:
        out.update(first_half=list(range(world // 2)), second_half=list(range(world // 2, world)),
                   even=list(range(0, world, 2)), odd=list(range(1, world, 2)))
    return out


def draw(rng: random.Random, groups: dict[str, list[int]], max_bytes: int) -> dict:
    """The next call of the sequence: the same on every rank, and in both jobs, for one seed."""
    kind, dtype = rng.choice(KINDS), rng.choice(DTYPES)
    name = rng.choice(list(groups))
    nbytes = 0 if rng.random() < 0.01 else int(2 ** rng.uniform(0, math.log2(max_bytes)))
    numel = nbytes // dtype.itemsize
    if kind == "reduce_scatter":
        numel -= numel % len(groups[name])
    return {"kind": kind, "dtype": dtype, "group": name, "members": groups[name], "numel": numel,
            "op": rng.choice(list(REDUCE_OPS)) if kind != "all_gather" else None}


def describe(call: dict) -> str:
    return f"{call['kind']} {call['op'] or ''} {call['dtype']} x {call['numel']} on {call['group']}"


def _view(buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return buffer[: numel * dtype.itemsize].view(dtype)


def _run(call: dict, group, x: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    size = len(call["members"])
    if call["kind"] == "all_reduce":
        dist.all_reduce(x, op=REDUCE_OPS[call["op"]], group=group)
        return x
    if call["kind"] == "reduce_scatter":
        out = _view(outputs, x.numel() // size, x.dtype)
        dist.reduce_scatter_tensor(out, x, op=REDUCE_OPS[call["op"]], group=group)
    else:
        out = _view(outputs, x.numel() * size, x.dtype)
        dist.all_gather_into_tensor(out, x, group=group)
    return out


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of a contiguous tensor's bytes."""
    return zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy())


def _checked(call: dict, group, seed: int, inputs: torch.Tensor, outputs: torch.Tensor) -> int:
    """The checksum of ``call``'s result on ``group``, its input drawn into ``inputs`` and its
    result (but an all-reduce's, made in place) written into ``outputs``."""
    x = _view(inputs, call["numel"], call["dtype"]).random_(-8, 9, generator=torch.Generator().manual_seed(seed))
    return checksum(_run(call, group, x, outputs))


def soak(args) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = "gloo" if args.reference else None  # None: the default group's, slipstream
    groups = members(world)
    made = {name: dist.group.WORLD if name == "world" else dist.new_group(ranks, backend=backend)
            for name, ranks in groups.items()}
    meet = dist.new_group(list(range(world)), backend="gloo")  # the readings' barriers, the report
    rng = random.Random(args.seed)  # the same draws on every rank
    pids: list = [None] * world  # the job's segments are named by its ranks' pids
    dist.all_gather_object(pids, os.getpid(), group=meet)
    sums = array.array("L", bytes(array.array("L").itemsize * args.collectives))  # before the first reading
    inputs = torch.ones(args.max_bytes, dtype=torch.uint8)  # written: resident from the start
    outputs = torch.ones(args.max_bytes * world, dtype=torch.uint8)
    buffers_mib = (inputs.numel() + outputs.numel()) / 2**20

    def read() -> dict:  # once every rank is here: none is half-way through setting up a group's segment
        dist.barrier(group=meet)
        return usage(args.trim, set(pids)) | {"buffers_mib": buffers_mib}

    snapshots = {"start": read()}
    by_kind, started = {}, time.perf_counter()
    for i in range(args.collectives):
        call = draw(rng, groups, args.max_bytes)
        if rank in call["members"]:
            sums[i] = _checked(call, made[call["group"]], args.seed * 1_000_003 + i * 64 + rank, inputs, outputs)
            by_kind[call["kind"]] = by_kind.get(call["kind"], 0) + 1
        if i + 1 == min(1000, args.collectives):
            snapshots["after_1000"] = read()
        if i + 1 == args.collectives // 2:
            snapshots["middle"] = read()
    snapshots["end"] = read()
    calls_s = time.perf_counter() - started
    cycles_wrong = _group_cycles(args.groups, world, rng, backend)
    snapshots["after_groups"] = read()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, {"rank": rank, "snapshots": snapshots, "checksums": sums.tolist(),
                                      "by_kind": by_kind, "cycles_wrong": cycles_wrong}, group=meet)
    return {"world_size": world, "collectives": args.collectives, "group_cycles": args.groups, "calls_s": calls_s,
            "backend": backend or "slipstream", "ranks": everyone}


def _group_cycles(n: int, world: int, rng: random.Random, backend: str | None) -> int:
    """``n`` subgroups made on ``backend`` (None: the default, slipstream), used once,
    destroyed; how many gave a wrong sum."""
    rank, wrong = dist.get_rank(), 0
    for _ in range(n):
        ranks = sorted(rng.sample(range(world), rng.randint(min(2, world), world)))
        numel = 1 + rng.randrange(1 << 16)
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            x = torch.full((numel,), float(rank + 1))
            dist.all_reduce(x, group=group)
            wrong += not bool((x == sum(r + 1 for r in ranks)).all())
        dist.destroy_process_group(group)
    return wrong


def _join(args) -> None:
    dist.init_process_group("gloo" if args.reference else "slipstream")


if __name__ == "__main__":
    run_worker(soak, options={"--collectives": int, "--groups": int, "--max-bytes": int, "--seed": int,
                              "--reference": False, "--trim": False},
               group=_join)
