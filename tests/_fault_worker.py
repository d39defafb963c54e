"""One rank of a fault-injection case (``test_faults.py``): ``python _fault_worker.py CASE``.

Environment: the usual RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (the store is the
harness's, as torchrun's agent holds it), ``FAULT_VICTIM`` (the rank that does the fault),
``FAULT_OP`` (all_reduce, reduce_scatter, all_gather), ``FAULT_PG_TIMEOUT`` (the group's
timeout, seconds), plus any ``SLIPSTREAM_*``.

Cases, from the victim's side (every other rank keeps calling ``FAULT_OP`` on a 16 MiB tensor):
    before_first    exits right after ``init_process_group``
    setup           exits during the communicator's set-up, holding a new shared-memory segment
    mid             exits 50 ms into its 4th collective (from a timer thread)
    overlapped      as mid, while every rank issues its collectives with ``async_op=True`` and
                    computes (a matmul) until it waits on each
    queued          as mid, while every rank issues ``QUEUED`` collectives with ``async_op=True``
                    back to back, then waits on each in turn (as a framework's gradient buckets)
    frozen          stops itself (SIGSTOP) before its 4th collective
    mismatch        calls its 4th collective with a different size
    other_call      calls a broadcast where the others call ``FAULT_OP``
    fsdp            FSDP2 training through ``slipstream.fsdp.apply``: exits 50 ms into step 4
    megatron        megatron-core TP=2 x DP layers (column- then row-parallel, gradients averaged
                    over the data-parallel group): exits 50 ms into step 4, inside the TP
                    all-reduces
    deepspeed       ZeRO-2 (``FAULT_ZERO=3``: ZeRO-3) through the DeepSpeed adapter: exits 50 ms
                    into step 4 (with ``SLIPSTREAM_OVERLAP=1``, buckets of 256 Ki elements,
                    reduced during backward)

Each rank prints ``FAULT <unix time>`` just before its fault (or mismatched call), and a rank
whose collective raises prints ``ERROR <type>: <message>`` and exits 1. A rank that completes
every collective exits 0.
"""

import faulthandler
import importlib
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import slipstream
from _stack_steps import make_step

N = 4 << 20  # 16 MiB of float32: above the hierarchical path's minimum
CALLS = 200  # back to back: a fault from a timer lands inside one of them
QUEUED = 8
TEARDOWN_S = 15.0  # past the harness's bound on a survivor's exit (test_faults.py)


def _fault_now() -> None:
    print(f"FAULT {time.time():.3f}", flush=True)


def _die_holding_a_segment() -> None:
    """Make group rank 0 of the communicator exit once its segment exists, before the others
    learn the name (the set-up's window in which only the creator knows it)."""
    from slipstream.core_comm.collectives import segment as _shm_segment

    class Dist:
        def __getattr__(self, name):
            return getattr(dist, name)

        @staticmethod
        def broadcast_object_list(*args, **kwargs):
            _fault_now()
            os._exit(3)

    _shm_segment.dist = Dist()


def _call(op: str, x: torch.Tensor, world: int, async_op: bool = False):
    if op == "all_reduce":
        return dist.all_reduce(x, async_op=async_op)
    if op == "reduce_scatter":
        return dist.reduce_scatter_tensor(torch.empty(x.numel() // world), x, async_op=async_op)
    return dist.all_gather_into_tensor(torch.empty(x.numel() * world), x, async_op=async_op)


def _call_while_computing(op: str, x: torch.Tensor, world: int) -> None:
    """The collective in flight while this thread computes, then waited on."""
    work = _call(op, x, world, async_op=True)
    a = torch.randn(256, 256)
    for _ in range(4):
        a = torch.tanh(a @ a)
    work.wait()


def main(case: str) -> int:
    slipstream.enable()
    dist.init_process_group("slipstream", timeout=timedelta(seconds=float(os.environ["FAULT_PG_TIMEOUT"])))
    rank, world = dist.get_rank(), dist.get_world_size()
    victim = rank == int(os.environ.get("FAULT_VICTIM", "1"))
    op = os.environ.get("FAULT_OP", "all_reduce")
    # Every rank is past init_process_group (whose own failures are torch's) before any fault.
    _all_ready("fault-ready", rank, world)
    if victim and case == "before_first":
        _fault_now()
        os._exit(3)
    if victim and case == "setup":
        _die_holding_a_segment()
    if case in ("fsdp", "megatron"):
        return _train(case, victim)
    if case == "deepspeed":
        return _train("deepspeed3" if os.environ.get("FAULT_ZERO") == "3" else "deepspeed", victim)
    x = torch.ones(N)
    try:
        for i in range(CALLS):
            if victim and i == 3:
                if case in ("mid", "overlapped", "queued"):
                    threading.Timer(0.05, _fault_now_and_exit).start()
                elif case == "frozen":
                    _fault_now()
                    os.kill(os.getpid(), signal.SIGSTOP)
                elif case == "mismatch":
                    _fault_now()
                    x = torch.ones(N + 1024)
                elif case == "other_call":
                    _fault_now()
                    dist.broadcast(x, 0)
                    continue
            elif i == 3 and case in ("mismatch", "other_call"):
                _fault_now()  # the disagreement starts when the last rank makes its call
            if case == "overlapped":
                _call_while_computing(op, x, world)
            elif case == "queued":
                for work in [_call(op, x, world, async_op=True) for _ in range(QUEUED)]:
                    work.wait()
            else:
                _call(op, x, world)
    except Exception as e:  # noqa: BLE001 - reported to the harness
        _report(e)  # with the interpreter's teardown, as a script that raises has
    dist.destroy_process_group()
    return 0


def _all_ready(tag: str, rank: int, world: int) -> None:
    """Wait, on the store (60 s, not the group's short timeout), until every rank got here."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{tag}/{rank}", "1")
    store.wait([f"{tag}/{r}" for r in range(world)], timedelta(seconds=60))


_FRAMEWORK = {"deepspeed": "deepspeed", "deepspeed3": "deepspeed", "fsdp": "torch.distributed.fsdp",
              "megatron": "megatron.core"}


def _train(stack: str, victim: bool) -> int:
    """Steps of ``stack`` (``_stack_steps.py``); the victim exits 50 ms into step 4. Every rank
    imports the framework, then waits for the others: the set-up's first collective (ZeRO-3's
    broadcast) must not wait past the group's 5 s timeout for a rank still importing."""
    importlib.import_module(_FRAMEWORK[stack])
    _all_ready("stack-ready", dist.get_rank(), dist.get_world_size())
    try:
        step = make_step(stack)
        for i in range(200):
            if victim and i == 3:
                threading.Timer(0.05, _fault_now_and_exit).start()
            step(i)
    except Exception as e:  # noqa: BLE001 - reported to the harness
        _report(e)
    return 0


def _report(e: Exception) -> None:
    """The harness reads these lines; then exit 1 with the interpreter's teardown, as a script
    that raises has."""
    traceback.print_exc()
    print(f"RAISED {time.time():.3f}", flush=True)
    print(f"ERROR {type(e).__name__}: {e}", flush=True)
    # A teardown that outlasts the harness's bound shows where each thread waits, in the log.
    faulthandler.dump_traceback_later(TEARDOWN_S, exit=False)
    sys.exit(1)


def _fault_now_and_exit() -> None:
    _fault_now()
    os._exit(3)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
