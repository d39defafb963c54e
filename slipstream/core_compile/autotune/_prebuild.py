"""The compile process of ``background``: ``python -m slipstream.core_compile.autotune._prebuild DIR PID``.

Loads ``DIR/job.pt`` (the model, the strategy's name, a batch, the training process's thread
count and autocast state), lists the graph breaks if asked (``diagnose.graph_breaks``),
compiles the strategy as the training process does (``strategy.build``), runs one forward and
one backward (``torch.autograd.grad``: the backward graph compiles too), if asked times a
forward and backward of eager and of the compiled strategy in turns (``_timed``), writes
``DIR/done`` (its graphs, how many inductor generated or loaded from its cache, the graph breaks
and the timings) and waits to be stopped. It exits on its own once its parent is gone
(removing ``DIR``) or, still compiling, once ``timeout_s`` has passed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import threading
import time

TURNS, PER_TURN = 3, 3
"""The timing's turns of eager and the compiled strategy, and the steps of each turn."""
TIMING_S = 30.0
"""The timing stops after the turn that passes this (or half the job's timeout)."""


def _watch(parent: int, deadline: float, directory: str, finished: threading.Event) -> None:
    """End this process when the training process is gone (then remove ``directory``: nobody
    else will, as when a rank ends with ``os._exit``) or, before ``finished``, the time is up."""
    while os.getppid() == parent and (finished.is_set() or time.monotonic() < deadline):
        time.sleep(0.5)
    if os.getppid() != parent:
        shutil.rmtree(directory, ignore_errors=True)
    os._exit(0 if finished.is_set() else 3)


def _timed(runs: dict, step, limit_s: float) -> dict:
    """Seconds of a step (``step(forward)``) of each of ``runs`` (name -> (switch it on, its
    forward)), in turns of ``PER_TURN`` steps each, the first untimed (a step after a switch
    of strategy is slower, see the autotuner), for ``TURNS`` turns or until ``limit_s`` has
    passed at the end of one."""
    times: dict = {name: [] for name in runs}
    end = time.monotonic() + limit_s
    for _ in range(TURNS):
        if time.monotonic() > end:
            break
        for name, (switch, forward) in runs.items():
            switch()
            for i in range(PER_TURN):
                start = time.perf_counter()
                step(forward)
                if i:
                    times[name].append(time.perf_counter() - start)
    return times


def main(directory: str, parent: int) -> int:
    import torch

    from . import check, diagnose, strategy
    from .background import as_received

    # the lowest priority: training's threads come first, the compile takes what they leave
    os.nice(19)
    job = torch.load(os.path.join(directory, "job.pt"), weights_only=False)
    finished = threading.Event()
    deadline = time.monotonic() + job["timeout_s"]
    threading.Thread(target=_watch, args=(parent, deadline, directory, finished), daemon=True).start()
    torch.set_num_threads(job["threads"])  # inductor's CPU kernels and its cache key follow it
    module = job["module"]
    job["args"], job["kwargs"] = as_received(job["args"]), as_received(job["kwargs"])
    chosen = next(s for s in strategy.STRATEGIES if s.name == job["strategy"])
    listing = {}

    def autocast() -> contextlib.ExitStack:
        """The training process's autocast state (it shapes the traced graph)."""
        stack = contextlib.ExitStack()
        for device_type, dtype in job["autocast"].items():
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        return stack

    if job["list_breaks"]:  # before the compile: explain resets dynamo
        with autocast():
            count, breaks = diagnose.list_breaks(module, module.forward, job["args"], job["kwargs"])
        listing = {"graph_count": count, "graph_breaks": [[b.reason, b.where] for b in breaks]}
    applied = strategy.build(chosen, module.forward, strategy.hook_free_regions(strategy.repeated_blocks(module)))
    params = [p for p in module.parameters() if p.requires_grad]

    def step(forward) -> None:
        """One forward and its backward."""
        with autocast():
            loss = check._loss(forward(*job["args"], **job["kwargs"]))
        if params and loss.requires_grad:
            torch.autograd.grad(loss, params, allow_unused=True)

    applied.activate()
    step(applied.forward or module.forward)
    from torch._dynamo.utils import counters

    cache = counters["inductor"]
    result = {"graphs": applied.counter.graphs, "backend_s": applied.counter.seconds,
              "generated": cache["fxgraph_cache_miss"], "loaded": cache["fxgraph_cache_hit"], **listing}
    if job["timed"]:  # within half the time left: the timing must not be what ends the process
        runs = {"eager": (applied.deactivate, module.forward),
                "compiled": (applied.activate, applied.forward or module.forward)}
        result["timed"] = _timed(runs, step, min(TIMING_S, (deadline - time.monotonic()) / 2))
    print(json.dumps(result), flush=True)
    with open(os.path.join(directory, "done.tmp"), "w") as f:
        json.dump(result, f)
    os.rename(os.path.join(directory, "done.tmp"), os.path.join(directory, "done"))
    finished.set()
    while True:  # until the training process stops it, or is gone (_watch)
        time.sleep(3600)


if __name__ == "__main__":
    # the parent's pid from the parent: one gone before this process looked is seen too
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
