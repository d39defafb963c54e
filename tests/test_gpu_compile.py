"""``slipstream.compile`` on CUDA (GPU machines only): a compiled strategy trains like eager,
and the search costs no more than its budget (on an H100 the max-autotune candidate once ran
past a 40 s budget for minutes: benchmarks/results/gpu_h100_2026-11-26.md)."""

import copy

import pytest
import torch

import slipstream
from slipstream import CompileConfig

pytestmark = pytest.mark.gpu

BUDGET_SLACK_S = 10.0
"""What one candidate may overrun the budget by: the budget is checked against estimates."""


class _Net(torch.nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d), torch.nn.GELU(),
                                torch.nn.Linear(2 * d, d)) for _ in range(3))
        self.head = torch.nn.Linear(d, 4)

    def forward(self, x, y):
        for block in self.blocks:
            x = x + block(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), y.flatten())


def _batches(n: int):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, 64, generator=g).cuda(), torch.randint(0, 4, (8, 16), generator=g).cuda())
            for _ in range(n)]


def _train(model, batches, until=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if until is not None and until(model):
            break
    return torch.tensor(losses)


def _config(tmp_path, **kw):
    return CompileConfig(cache=False, cache_dir=str(tmp_path / "cache"), verbose=False, background=False, **kw)


def test_inductor_on_cuda_trains_like_eager(tmp_path):
    torch.manual_seed(0)
    eager = _Net().cuda()
    model = copy.deepcopy(eager)
    slipstream.compile(model, config=_config(tmp_path, strategy="inductor"))
    batches = _batches(6)
    ref, ours = _train(eager, batches), _train(model, batches)
    report = slipstream.compile_report(model)
    assert report.chosen == "inductor" and report.fallback is None, report.table()
    assert next(c for c in report.candidates if c.name == "inductor").graphs >= 1  # it really compiled
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_the_search_on_cuda_costs_at_most_its_budget(tmp_path):
    torch.manual_seed(0)
    eager = _Net().cuda()
    model = copy.deepcopy(eager)
    budget = 15.0
    slipstream.compile(model, config=_config(tmp_path, budget_s=budget, measure_rounds=2))
    batches = _batches(120)
    ours = _train(model, batches, until=lambda m: slipstream.compile_report(m).decided_at_step is not None)
    report = slipstream.compile_report(model)
    assert report.decided_at_step is not None, f"no choice in {len(ours)} steps:\n{report.table()}"
    assert report.overhead_s() <= budget + BUDGET_SLACK_S, report.table()
    # whichever strategy won: its fused kernels sum in another order than eager's
    torch.testing.assert_close(ours, _train(eager, batches[:len(ours)]), rtol=1e-3, atol=1e-5)
