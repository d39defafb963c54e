"""slipstream.compile within its budget: a compile process that outruns its share is killed, its
candidate abandoned and the search goes on; the kernel search (max-autotune) is measured only
where its first shapes say the rest fits.

The slow compiles are stand-ins: a custom op whose fake (tracing) kernel sleeps, in a compile
process only, as long as a GPU's kernel search takes for a shape, and then tells inductor's
feedback hook that a shape was searched, as inductor does after benchmarking one. Its eager
kernel is the identity, so the model trains as ``Net`` does; the reference is eager ``Net``
from the same weights on the same batches.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import pytest
import torch

import slipstream
from test_compile import Net, _batches, _cfg, _prebuild_dirs, _train, _train_until_decided

pytestmark = pytest.mark.skipif(
    __import__("slipstream.core_compile.varlen.fuse", fromlist=["compiler_problem"]).compiler_problem("cpu") is not None,
    reason="torch.compile cannot run on this machine's CPU (no C++ compiler)")


def _in_compile_process() -> bool:
    return getattr(sys.modules["__main__"].__spec__, "name", "") == "slipstream.core_compile.autotune._prebuild"


@torch.library.custom_op("slipstream_tests::stand_in_search", mutates_args=())
def stand_in_search(x: torch.Tensor, seconds: float) -> torch.Tensor:
    return x.clone()


@stand_in_search.register_fake
def _(x, seconds):
    if _in_compile_process():
        from torch._inductor import select_algorithm

        time.sleep(seconds)
        for searched in select_algorithm.get_algorithm_selector_cache().feedback_saver_fns:
            searched({}, "stand-in", [], [], dict, {})
    return torch.empty_like(x)


class Searched(Net):
    """Net whose compile, in a compile process, takes ``seconds`` per kernel shape searched. Its
    graph holds 3 distinct linear shapes (the blocks' two, the head's), each with its input and
    weight needing gradients: 9 shapes expected in a training step."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x, y):
        return super().forward(stand_in_search(x, self.seconds), y)


class Small(torch.nn.Module):
    """One linear layer and its loss: a quick compile (of few kernels), for a search that fits."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), y.flatten())


class SmallSearched(Small):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x, y):
        return super().forward(stand_in_search(x, self.seconds), y)


def _pair(seconds: float, small: bool = False):
    torch.manual_seed(0)
    eager, model = (Small(), SmallSearched(seconds)) if small else (Net(), Searched(seconds))
    model.load_state_dict(eager.state_dict())
    return eager, model


def _group_alive(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (the compile process and what it started)."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(pid))
    return alive


@pytest.fixture(autouse=True)
def own_graphs(new_compile_graphs):
    """Graphs of each test's own, for the compile process and this one: a graph of these models
    compiled by an earlier run on this machine would load from the machine's cache, and the
    compile these tests bound (a search that takes its time) would not happen."""


@pytest.fixture
def cheap_estimates(monkeypatch):
    """Every candidate is expected to compile in 0.1 s (so a budget of seconds admits it)."""
    from slipstream.core_compile.autotune import budget

    monkeypatch.setattr(budget, "DEFAULT_S_PER_MODULE", {"model": 0.01, "regions": 0.01})
    monkeypatch.setattr(budget, "FIRST_COMPILE_S", 0.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["waited", "beside"])
def test_a_compile_outrunning_its_share_is_killed_with_its_processes_and_the_search_goes_on(
        tmp_path, cheap_estimates, path):
    """waited: max-autotune, searching kernels, in a compile process the training process waits
    for (CUDA's default); beside: inductor beside training (``background=True``). Either compile
    stalls for 600 s: it is killed once its share (the 6 s budget) is spent."""
    eager, model = _pair(seconds=600.0)
    batches = _batches(4)
    name, settings = {"waited": ("max-autotune", {"strategies": ("max-autotune", "inductor"), "max_autotune": True}),
                      "beside": ("inductor", {"strategies": ("inductor",), "background": True})}[path]
    before = _prebuild_dirs()
    slipstream.compile(model, config=_cfg(tmp_path, budget_s=6.0, measure_rounds=2, **settings))
    start = time.monotonic()
    ours, ref = _train_until_decided(model, eager, batches, limit_s=60)
    report = slipstream.compile_report(model)
    by = {c.name: c for c in report.candidates}
    pre = model.forward.prebuilds.started[name]
    assert by[name].status == "abandoned", report.table()
    if by[name].reason.startswith("its compile outran its share: "):  # killed once its share was spent
        assert 0 < pre.took_s - pre.limit_s < 2.0 and pre.limit_s <= 6.0, (pre.took_s, pre.limit_s)
    else:  # beside training, on a CPU whose cores training takes, its cost to training reached the budget first
        assert path == "beside" and by[name].reason.startswith("its compile process was stopped: "), report.table()
        assert pre.took_s < pre.limit_s + 2.0
    assert by[name].outran_s == pytest.approx(pre.took_s)
    assert time.monotonic() - start < 30  # not the 600 s the compile would have taken
    assert _group_alive(pre._proc.pid) == [] and _prebuild_dirs() == before
    if path == "waited":  # the budget spent waiting: the next candidate is weighed, and does not fit
        assert by["inductor"].status == "skipped" and "budget left" in by["inductor"].reason, report.table()
    assert report.chosen == "eager" and by[name].graphs == 0, report.table()
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)  # eager every step
    assert "abandoned" in report.table()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("seconds, budget_s, measured", [(5.0, 40.0, False), (0.0, 600.0, True)],
                         ids=["over-its-share", "within-its-share"])
@pytest.mark.slow
def test_max_autotune_is_measured_only_where_its_first_shapes_say_its_search_fits(
        tmp_path, cheap_estimates, seconds, budget_s, measured):
    """5 s per shape, 9 shapes: 45 s and more, over a 40 s share, known at the first shape (5 s
    after the compile began, itself up to 15 s after the compile process started on a loaded
    2-core machine) and stopped then; with no delay, a small model compiles there, then here from
    the cache, and trains like eager."""
    eager, model = _pair(seconds, small=measured)
    before = _prebuild_dirs()
    slipstream.compile(model, config=_cfg(tmp_path, budget_s=budget_s, measure_rounds=2, max_autotune=True,
                                          strategies=("max-autotune",), graph_breaks=False))
    inductor = torch._dynamo.utils.counters["inductor"]
    generated = inductor["fxgraph_cache_miss"]
    ours, ref = _train_until_decided(model, eager, _batches(4), limit_s=150)
    report = slipstream.compile_report(model)
    cand = next(c for c in report.candidates if c.name == "max-autotune")
    pre = model.forward.prebuilds.started["max-autotune"]
    assert _group_alive(pre._proc.pid) == [] and _prebuild_dirs() == before
    if not measured:
        assert cand.status == "abandoned", report.table()
        assert cand.reason.startswith("its kernel search is expected to take about"), report.table()
        assert "9 kernel shapes" in cand.reason and "over its share of" in cand.reason, report.table()
        assert pre.took_s < pre.limit_s - 5 and cand.outran_s > pre.limit_s, (pre.took_s, pre.limit_s, cand.outran_s)
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)
        return
    assert cand.status in ("measured", "chosen") and cand.graphs >= 1, report.table()
    assert cand.beside.startswith("compiled in a compile process training waited for first"), cand.beside
    assert inductor["fxgraph_cache_miss"] == generated, report.table()  # its search is not made again here
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-6)


def test_the_expected_kernel_search_comes_from_the_shapes_searched_so_far():
    from slipstream.core_compile.autotune import bounded

    assert bounded.outran(5.0, 10.0, None) is None
    why, expected = bounded.outran(10.5, 10.0, None)
    assert why == "its compile outran its share: 10.5 s of 10.0 s" and expected == 10.5
    # the first of 9 shapes done 3 s into the compile: 8 more at 3 s, 24 s from now
    why, expected = bounded.outran(4.0, 20.0, {"expected": 9, "searched": 1, "last_s": 3.0})
    assert expected == pytest.approx(28.0) and "9 kernel shapes at 3.0 s each, from the first 1" in why
    assert bounded.outran(4.0, 30.0, {"expected": 9, "searched": 1, "last_s": 3.0}) is None
    # more shapes searched than counted: none is expected beyond them
    assert bounded.outran(4.0, 5.0, {"expected": 2, "searched": 3, "last_s": 3.0}) is None


def test_the_kernel_shapes_of_a_training_step_are_counted_from_its_graph():
    from slipstream.core_compile.autotune import bounded

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = Net()
    torch.compile(model, backend=backend)(*_batches(1)[0])
    # linear 16->32 and 32->16 (three blocks alike), 16->4: each forward, and its input's and weight's gradients
    assert bounded.searched_shapes(graphs[0]) == 9
    with torch.no_grad():
        graphs.clear()
        torch._dynamo.reset()
        torch.compile(copy.deepcopy(model).requires_grad_(False), backend=backend)(*_batches(1)[0])
    assert bounded.searched_shapes(graphs[0]) == 3  # inference: the forward's alone


def test_a_kernel_search_abandoned_before_is_expected_to_take_as_long_again(tmp_path):
    from slipstream.core_compile.autotune import budget, strategy
    from slipstream.core_compile.autotune.config import Candidate, CompileReport

    s = next(s for s in strategy.STRATEGIES if s.name == "max-autotune")
    key = {"model": "m1", "model_class": "Net", "inputs": [[4, 12]], "device": "cuda: x", "torch": "t"}
    report = CompileReport(module="Net", candidates=[Candidate("eager", step_s=[1.0]), Candidate(
        "max-autotune", status="abandoned", background_s=12.0, outran_s=270.0)])
    budget.store_priors(tmp_path, key, report, {"max-autotune": ("model", 10)}, cold=None)
    priors = budget.load_priors(tmp_path, {**key, "inputs": [[4, 20]]})
    expected, source = priors.compile_s(s, 10, cold=True)
    assert expected == 270.0 and "abandoned before for outrunning its share" in source
    assert priors.lost("max-autotune", 1.05) is None  # a longer run may afford it
