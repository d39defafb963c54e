"""The compile process of ``background``: ``python -m slipstream.core_compile.autotune._prebuild DIR PID``,
and what it is sent besides the model: the step's batch, its views still views (``as_sent``),
the autocast state the step runs under (``autocast_state``), the model's ``forward`` as it was
before ``slipstream.compile`` (``forward_as``).

Loads ``DIR/job.pt`` (the model, the strategy's name, a batch, the training process's thread
count and autocast state), lists the graph breaks if asked (``diagnose.graph_breaks``),
compiles the strategy as the training process does (``strategy.build``), runs one forward and
one backward (``torch.autograd.grad``: the backward graph compiles too), if asked times a
forward and backward of eager and of the compiled strategy in turns (``_timed``), writes
``DIR/done`` (its graphs, how many inductor generated or loaded from its cache, the graph breaks
and the timings) and waits to be stopped. A strategy that searches kernels reports its
search as it goes (``bounded.Progress``, ``DIR/progress``). It ends on its own, its whole process
group with it, once its parent is gone (removing ``DIR``) or, still compiling, once its share
(``limit_s``) has passed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time

import torch

__all__ = ["as_sent", "autocast_state", "forward_as", "main"]

TURNS, PER_TURN = 3, 3
"""The timing's turns of eager and the compiled strategy, and the steps of each turn."""
TIMING_S = 30.0
"""The timing stops after the turn that passes this (or half the time left of its share)."""


def _watch(parent: int, deadline: float, directory: str, finished: threading.Event) -> None:
    """End this process when the training process is gone (then remove ``directory``: nobody
    else will, as when a rank ends with ``os._exit``) or, before ``finished``, the time is up:
    with its group, where it leads one (started by ``background.Prebuild``), so that inductor's
    compile workers and autotuning processes go too."""
    while os.getppid() == parent and (finished.is_set() or time.monotonic() < deadline):
        time.sleep(0.5)
    if os.getppid() != parent:
        shutil.rmtree(directory, ignore_errors=True)
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
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
    from . import bounded, check, diagnose, strategy

    # the lowest priority: training's threads come first, the compile takes what they leave
    os.nice(19)
    job = torch.load(os.path.join(directory, "job.pt"), weights_only=False)
    finished = threading.Event()
    deadline = time.monotonic() + job["limit_s"]
    threading.Thread(target=_watch, args=(parent, deadline, directory, finished), daemon=True).start()
    torch.set_num_threads(job["threads"])  # inductor's CPU kernels and its cache key follow it
    module = job["module"]
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
    if bounded.searches_kernels(chosen):  # after the listing: its trace is no part of the search
        progress = bounded.Progress(directory)
        if progress.watch():
            applied.counter.on_graph = progress.graph
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


class _View:
    """A view among the step's inputs, sent as its base and its geometry and unpickled as a view
    again (``__reduce__``: by ``_view``, a function of the importable module, so ``__main__``'s
    copy of this class is never needed). A pickle keeps a view's storage but not that it is a
    view, and dynamo names a view's sizes after its base's (``L['input_ids']._base.size()[0]``):
    rebuilt as a view, the compile process's graphs are named as the training process's, so
    found in the cache. A packed llama's row (made by ``unsqueeze``) under inductor-dynamic: 0
    of its 2 graphs found, else 2 of 2."""

    def __init__(self, t: torch.Tensor) -> None:
        self.base, self.geometry = t._base.detach(), (tuple(t.size()), t.stride(), t.storage_offset())

    def __reduce__(self):
        return _view, (self.base, *self.geometry)


def _view(base: torch.Tensor, size, stride, offset: int) -> torch.Tensor:
    return base.as_strided(size, stride, offset)


def as_sent(tree):
    """``tree`` (a step's ``args`` or ``kwargs``) with each view that needs no gradient as a
    ``_View``: a view again in the compile process."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: _View(t) if isinstance(t, torch.Tensor) and t._is_view() and not t.requires_grad
                    else t, tree)


def autocast_state() -> dict:
    """The autocast state the step runs under, per device type (it shapes the traced graph)."""
    return {d: torch.get_autocast_dtype(d) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)}


@contextlib.contextmanager
def forward_as(module: torch.nn.Module, forward):
    """``module.forward`` is ``forward`` inside (None: the class's), the autotuner's wrapper put
    back after: the copy is the model as it was before ``slipstream.compile``."""
    had = "forward" in vars(module)
    mine = vars(module).get("forward")
    if forward is None:
        vars(module).pop("forward", None)
    else:
        module.forward = forward
    try:
        yield
    finally:
        if had:
            module.forward = mine
        else:
            vars(module).pop("forward", None)


if __name__ == "__main__":
    # the parent's pid from the parent: one gone before this process looked is seen too
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
