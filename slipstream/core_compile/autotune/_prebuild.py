"""The compile process of ``background``: ``python -m slipstream.core_compile.autotune._prebuild DIR``.

Loads ``DIR/job.pt`` (the model, the strategy's name, a batch, the training process's thread
count and autocast state), compiles the strategy as the training process does
(``strategy.build``), runs one forward and one backward (``torch.autograd.grad``: the backward
graph compiles too), writes ``DIR/done`` (its graphs, and how many inductor generated or
loaded from its cache) and exits 0. It exits on its own once its parent is
gone or ``timeout_s`` has passed.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time


def _watch(parent: int, deadline: float) -> None:
    """End this process when the training process is gone or the time is up."""
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.5)
    os._exit(3)


def main(directory: str) -> int:
    parent = os.getppid()  # before the imports and the load: a parent gone meanwhile is seen too
    import torch

    from . import check, strategy

    # the lowest priority: training's threads come first, the compile takes what they leave
    os.nice(19)
    job = torch.load(os.path.join(directory, "job.pt"), weights_only=False)
    threading.Thread(target=_watch, args=(parent, time.monotonic() + job["timeout_s"]), daemon=True).start()
    torch.set_num_threads(job["threads"])  # inductor's CPU kernels and its cache key follow it
    module = job["module"]
    chosen = next(s for s in strategy.STRATEGIES if s.name == job["strategy"])
    applied = strategy.build(chosen, module.forward, strategy.hook_free_regions(strategy.repeated_blocks(module)))
    with contextlib.ExitStack() as stack:
        for device_type, dtype in job["autocast"].items():
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        applied.activate()
        output = (applied.forward or module.forward)(*job["args"], **job["kwargs"])
        loss = check._loss(output)
    params = [p for p in module.parameters() if p.requires_grad]
    if params and loss.requires_grad:
        torch.autograd.grad(loss, params, allow_unused=True)
    from torch._dynamo.utils import counters

    cache = counters["inductor"]
    result = {"graphs": applied.counter.graphs, "backend_s": applied.counter.seconds,
              "generated": cache["fxgraph_cache_miss"], "loaded": cache["fxgraph_cache_hit"]}
    print(json.dumps(result), flush=True)
    with open(os.path.join(directory, "done"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
