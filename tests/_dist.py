"""Run a function on ``world_size`` CPU ranks with gloo and collect every rank's result.

Children are forked from a forkserver that has imported torch (and the stacks) once, so a test
pays the import cost a single time rather than once per rank. Failures from every rank are reported
together, and a rank that does not finish within ``timeout`` fails the test instead of
hanging CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

# torch 2.13's names, or 2.11's all_gather_into_tensor / reduce_scatter_tensor: the package's own choice
from slipstream.core_comm.compat import all_gather_into_tensor as all_gather_single
from slipstream.core_comm.compat import reduce_scatter_tensor as reduce_scatter_single

_CTX = mp.get_context("forkserver")
# The stacks the tests drive too, where installed (the server skips a missing one): each costs
# 1-3 s a process to import on 2 cores, paid here once instead of by every rank of every test.
# The start-up hook acts on DeepSpeed's import here as it would in each rank (its adapter does
# nothing to a job without a "slipstream" section).
_CTX.set_forkserver_preload(["torch", "torch.distributed", "deepspeed", "transformers", "megatron.core"])


def spellings(*names: str) -> list[tuple[str, Callable]]:
    """``(name, torch.distributed.<name>)`` for each spelling this torch has (torch 2.13 renamed
    ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single``, 2.11 has the old)."""
    import torch.distributed as dist

    return [(name, getattr(dist, name)) for name in names if hasattr(dist, name)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, port, env, args, queue, pg_timeout, backend="gloo", init_group=True):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if init_group:
            dist.init_process_group(
                backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout)
            )
        try:
            result = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict | None = None,
    rank_env: Sequence[dict] | None = None,
    pg_timeout: float = 60.0,
    allow_failures: bool = False,
    backend: str = "gloo",
    init_group: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on each rank; return results ordered by rank.

    ``env`` is set on every rank, ``rank_env[r]`` on rank ``r`` only (e.g. a node override).
    ``fn`` must be importable (defined at module level). With ``allow_failures`` a rank that
    raised or died yields an ``Exception`` holding its traceback instead of failing the call.
    ``backend`` is passed to ``init_process_group``; a non-stock one must be registered when
    ``fn``'s module is imported (the child imports it to unpickle ``fn``). With ``init_group``
    False the ranks start without a group (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and
    ``WORLD_SIZE`` set), for ``fn`` to make one.
    """
    port = free_port()
    queue = _CTX.Queue()
    procs = []
    for rank in range(world_size):
        merged = dict(env or {})
        if rank_env is not None:
            merged.update(rank_env[rank])
        p = _CTX.Process(
            target=_child, args=(fn, rank, world_size, port, merged, args, queue, pg_timeout, backend, init_group)
        )
        p.start()
        procs.append(p)
    results: dict[int, tuple[bool, Any]] = {}
    try:
        _collect(queue, procs, results, timeout)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        _clear_build_locks([p.pid for p in procs if p.exitcode is not None and p.exitcode < 0])
    missing = [r for r in range(world_size) if r not in results]
    failures = {r: v for r, (ok, v) in results.items() if not ok}
    if not allow_failures and (missing or failures):
        lines = [f"rank {r} did not finish within {timeout}s (exit code {procs[r].exitcode})" for r in missing]
        lines += [f"rank {r} failed:\n{tb}" for r, tb in sorted(failures.items())]
        raise AssertionError("\n".join(lines))
    out = []
    for r in range(world_size):
        ok, value = results.get(r, (False, f"no result (exit code {procs[r].exitcode})"))
        out.append(value if ok else Exception(value))
    return out


def _clear_build_locks(killed: list[int]) -> None:
    """A rank killed (a hang past the timeout) while it built or loaded DeepSpeed's op holds its
    build lock: removed, as the launcher does for its ranks."""
    if killed:
        from slipstream.plugins.deepspeed.build_lock import remove_locks_of

        remove_locks_of(set(killed))


def _collect(queue, procs, results: dict, timeout: float) -> None:
    """Fill ``results`` from the ranks' reports until every rank reported, every rank that
    did not has exited (killed, crashed), or ``timeout`` seconds passed (a hang)."""
    deadline = time.monotonic() + timeout
    while len(results) < len(procs) and time.monotonic() < deadline:
        silent_exited = all(procs[r].exitcode is not None for r in range(len(procs)) if r not in results)
        try:
            # A rank that exited has flushed its report into the pipe: a short wait drains it.
            rank, ok, value = queue.get(timeout=1.0 if silent_exited else 0.5)
        except Exception:  # queue.Empty
            if silent_exited:
                return
            continue
        results[rank] = (ok, value)


def to_bytes(obj) -> bytes:
    """A rank's result as bytes: a tensor sent as itself is shared through a file descriptor
    that dies with the rank that made it."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(results: list) -> list:
    import io

    import torch

    return [torch.load(io.BytesIO(b), weights_only=False) for b in results]


def int_values(rank: int, numel: int, dtype=None, seed: int = 0):
    """Integer-valued data of ``rank`` (-8..8): every summation order gives the same sum."""
    import torch

    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randint(-8, 9, (numel,), generator=gen).to(dtype or torch.float32)
