"""Compiles bounded by their share of the budget: a compile process that outruns it is killed.

A candidate compiled in a process of its own (``background``) may run for its *share*: what is
left of the search's budget when its process starts, in seconds of that process's time. Once
it has run that long without finishing, the training process kills it (its whole process
group: inductor's compile workers and autotuning processes with it) and records the candidate
as abandoned; it is never compiled in the training process, and the search goes on with the
next candidate or eager. The process also kills its own group at that time, should the
training process not look. One beside training is stopped too, and its candidate abandoned,
where the search's cost reaches its budget first (``background.Prebuilds.abandon``).

The kernel search (``max-autotune``) is where this matters: on an H100 inductor benchmarked
21-22 Triton matmul choices per shape, 26-30 s per shape, and a search given 40 s was killed
from outside at 130 s, inside one candidate (benchmarks/results/gpu_h100_2026-11-26.md). Its
length is not known before it starts, so it is learned from its first shapes: the compile
process counts the matmul shapes its graphs hold (``searched_shapes``) and reports each shape
searched (``Progress``, through inductor's feedback hook); the training process expects the
rest to take as long per shape as those did (``outran``), and stops it as soon as that is
over its share, not at the share's end. A candidate that searches kernels is compiled only in
such a process (``searches_kernels``): in the training process nothing could stop it.
"""

from __future__ import annotations

import json
import operator
import os
import time

import torch

__all__ = ["PRODUCTS", "PRODUCT_METHODS", "Progress", "outran", "read_progress", "searched_shapes", "searches_kernels"]

PRODUCTS = {torch._C._nn.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, operator.matmul,
            torch.conv1d, torch.conv2d, torch.conv3d}
"""The dynamo graph's calls that inductor's kernel search tunes (its ``tuned_mm`` family and
convolutions), as ``call_function`` targets; ``PRODUCT_METHODS`` as ``call_method`` names."""
PRODUCT_METHODS = {"matmul", "mm", "bmm", "addmm", "baddbmm", "__matmul__"}


def searches_kernels(s) -> bool:
    """Whether strategy ``s``'s mode benchmarks kernels while it compiles (inductor's
    ``max_autotune``): a compile whose length is not known before it runs."""
    if not s.compiled or s.mode is None:  # inductor's default mode: no search (and no import of inductor)
        return False
    from torch._inductor import list_mode_options

    return bool(list_mode_options(s.mode).get("max_autotune"))


def searched_shapes(gm: torch.fx.GraphModule) -> int:
    """The kernel shapes inductor is expected to search for a training step of ``gm`` (a dynamo
    graph, its nodes' ``example_value`` set): each distinct product (op and operand shapes), once
    for the forward and once more for each of its first two operands that needs a gradient (the
    backward's two products of a linear: the gradients of its input and of its weight)."""
    seen: dict = {}
    for node in gm.graph.nodes:
        if not (node.op == "call_function" and node.target in PRODUCTS
                or node.op == "call_method" and node.target in PRODUCT_METHODS):
            continue
        values = [a.meta.get("example_value") for a in node.args if isinstance(a, torch.fx.Node)][:2]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        key = (str(node.target), tuple(tuple(str(d) for d in t.shape) for t in tensors))
        seen[key] = 1 + sum(t.requires_grad for t in tensors)
    return sum(seen.values())


class Progress:
    """A compile process's kernel search, written for the training process to read
    (``read_progress``): the shapes expected (``graph``, at each graph the backend receives),
    the shapes searched so far and the seconds from the compile's start to the last one
    (``searched``, inductor's feedback hook). Written whole (renamed into place)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "progress")
        self.start = time.monotonic()
        self.expected = self.searched_n = 0
        self.last_s = 0.0

    def watch(self) -> bool:
        """Hear of each shape inductor searches from now on; False where this torch has no
        feedback hook (then only the share bounds the process)."""
        from torch._inductor import select_algorithm

        add = getattr(select_algorithm, "add_feedback_saver", None)
        if add is None:
            return False
        self.start = time.monotonic()
        add(self.searched)
        return True

    def graph(self, gm: torch.fx.GraphModule) -> None:
        self.expected += searched_shapes(gm)
        self._write()

    def searched(self, *_) -> None:
        """Inductor's feedback hook: called once per shape benchmarked (not for one found in its
        autotuning cache), with the timings, which are not needed here."""
        self.searched_n += 1
        self.last_s = time.monotonic() - self.start
        self._write()

    def _write(self) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump({"expected": self.expected, "searched": self.searched_n, "last_s": self.last_s}, f)
        os.replace(self.path + ".tmp", self.path)


def read_progress(directory: str) -> dict | None:
    """The compile process's last ``Progress``, or None before the first."""
    try:
        with open(os.path.join(directory, "progress")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def outran(elapsed: float, limit: float, progress: dict | None) -> tuple[str, float] | None:
    """(why, its expected seconds) where a compile process that has run ``elapsed`` seconds of a
    share of ``limit`` must be stopped now, or None: past its share, or its kernel search expected
    to end past it. The expectation: the shapes left (those its graphs hold, less those searched)
    at the mean time of those searched, each counted from the compile's start (so its tracing is
    spread over them: an overestimate at the first shape, which the later ones bring down)."""
    if elapsed > limit:
        return f"its compile outran its share: {elapsed:.1f} s of {limit:.1f} s", elapsed
    if not progress or not progress.get("searched"):
        return None
    done, per = progress["searched"], progress["last_s"] / progress["searched"]
    total = elapsed + per * max(progress["expected"] - done, 0)
    if total <= limit:
        return None
    return (f"its kernel search is expected to take about {total:.0f} s ({max(progress['expected'], done)} kernel "
            f"shapes at {per:.1f} s each, from the first {done}), over its share of {limit:.1f} s", total)
