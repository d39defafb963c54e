"""What the compile search may spend, in the run's own terms, and what each candidate is
expected to cost before it is compiled.

- **The budget.** With ``CompileConfig.expected_steps`` (the stack's or the user's run length),
  the search may cost at most ``budget_share`` of the run: that share of ``expected_steps``
  times eager's step time (the faster of the run's second and third steps); ``budget_s`` caps
  it. Without a run length, ``budget_s`` alone. The cost is what the search's steps take
  beyond the same steps of eager: compiling, checking, warming up, and the timed steps of a
  slower candidate.
- **The expected compile time** of a candidate, before it is compiled, from the first of:
  this model's own compile of that strategy on this machine (any batch shape, the ``family``
  record; for one abandoned there, what it was expected to take, ``bounded``); the seconds
  per compiled module of any model compiled on this machine (the ``machine`` record);
  ``DEFAULT_S_PER_MODULE``. On these last two, the process's first compile adds
  ``FIRST_COMPILE_S``. A candidate whose expected time does not fit in what is
  left of the budget is skipped, saying so.
- **The priors** from the family record: strategies that lost for this model on this machine
  are skipped; the last winner is measured first.

The records live next to the decisions (``cache``), keyed like them less the batch's shapes
(family) or less the model too (machine).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import cache as compile_cache
from .background import WARM_SHARE
from .strategy import Strategy

__all__ = ["DEFAULT_S_PER_MODULE", "Priors", "cannot_pay", "compiled_modules", "load_priors", "search_budget",
           "store_priors"]

DEFAULT_S_PER_MODULE = {"model": 0.5, "regions": 1.6}
"""Seconds of compile and check per compiled module (``compiled_modules``) before anything was
compiled on this machine: the medians of cold compiles measured on a 2-core x86 machine
(benchmarks/results/compile_epyc-2core-kvm_2026-11-24.md): the whole model 0.39 (ResNet-50),
0.49 (BERT-mini), 0.93 s (llama-20m, dynamic); the regions, counted once per block class,
0.4 (BERT), 1.6 (llama), 3.9 s (ResNet-50: its stages' shapes recompile the block)."""
FIRST_COMPILE_S = 25.0
"""Added to a default or machine-wide estimate when nothing has been compiled in this process
yet: inductor's start-up (its imports, its compile workers, the C++ toolchain's first runs).
Measured on a 2-core x86 machine: llama-20m's regions-dynamic took 41.5 s as the process's
first compile and 16.4 s after another (benchmarks/results/compile_xeon-2core-kvm_2026-11-26.md)."""
MACHINE_SAMPLES = 8
"""Rates kept per scope in the machine record (the median is used)."""


def search_budget(config, eager_step_s: float | None) -> tuple[float, str]:
    """(seconds the search may cost, how that was set)."""
    if config.expected_steps is None or eager_step_s is None:
        return config.budget_s, f"budget_s={config.budget_s:g} (the run's length is not known)"
    share = config.budget_share * config.expected_steps * eager_step_s
    basis = (f"{100 * config.budget_share:g}% of {config.expected_steps} steps of {eager_step_s:.3g} s "
             f"(eager's)")
    if share <= config.budget_s:
        return share, basis
    return config.budget_s, f"budget_s={config.budget_s:g}, under {basis}"


def cannot_pay(timed: tuple | None, expected_steps: int | None, step: int, eager_step_s: float | None) -> str | None:
    """Why a candidate compiled and timed beside training (``timed``: eager's forward and
    backward over its there, its compile there in seconds; ``Prebuilds.timed``) cannot pay for
    itself in the steps a run of ``expected_steps`` has left from ``step``, or None. Its gain
    is at most those steps times eager's step times the share of eager's forward and backward
    it saved there (the rest of a step, the optimizer, is not faster); its compile in training,
    the kernels loaded from the cache, is taken as ``WARM_SHARE`` of its compile there.
    ResNet-50 on 1 torch thread: ready at step 164 of 200, 1.45x eager's there, its compile in
    training took 4.1-4.4 s and the 36 steps left could save about 4 s: the run was 1.053x
    eager's (benchmarks/results/compile-beside_epyc-2core-kvm_2026-11-26.md). The ranks agree
    on every figure (``Prebuilds._screen``, the autotuner's budget)."""
    if timed is None or expected_steps is None or not eager_step_s:
        return None
    speedup, there = timed
    left = max(expected_steps - step + 1, 0)
    gain, cost = left * eager_step_s * (1 - 1 / speedup), WARM_SHARE * there
    if gain > cost:
        return None
    return (f"{speedup:.2f}x eager's forward and backward in its compile process, but at step {step} of "
            f"{expected_steps} it could save at most {gain:.3g} s, against its compile here of about {cost:.3g} s: "
            "it cannot pay for itself in this run")


def _leaves(module: torch.nn.Module) -> int:
    return sum(1 for m in module.modules() if next(m.children(), None) is None)


def compiled_modules(model: torch.nn.Module, s: Strategy, regions: list) -> int:
    """The modules ``s`` compiles: every leaf module of the model, or for regions the leaves of
    one region of each class (identical blocks share their graphs)."""
    if s.scope == "model":
        return _leaves(model)
    one_per_class = {type(r): r for r in regions}
    return sum(_leaves(r) for r in one_per_class.values())


@dataclass
class Priors:
    family: dict = field(default_factory=dict)
    """name -> {"compile_s", "speedup", "status"}: this model's earlier search on this machine."""
    winner: str | None = None
    rates: dict = field(default_factory=dict)
    """scope -> [seconds per compiled module, ...]: any model's compiles on this machine."""

    def compile_s(self, s: Strategy, modules: int, cold: bool) -> tuple[float, str]:
        """(expected seconds to compile and check ``s``, where the figure comes from). ``cold``:
        nothing compiled in this process yet (``FIRST_COMPILE_S`` more, on a per-module figure)."""
        seen = self.family.get(s.name, {})
        if seen.get("compile_s") and seen.get("status") == "abandoned":
            return seen["compile_s"], "this model's compile on this machine, abandoned before for outrunning its share"
        if seen.get("compile_s"):
            return seen["compile_s"], "this model's compile on this machine"
        if self.rates.get(s.scope):
            rate, where = statistics.median(self.rates[s.scope]), "as compiled on this machine"
        else:
            rate, where = DEFAULT_S_PER_MODULE[s.scope], "the default (nothing compiled here yet)"
        start = f" + {FIRST_COMPILE_S:g} s for inductor's start-up" if cold else ""
        return (rate * modules + FIRST_COMPILE_S * cold,
                f"{modules} modules x {rate:.2f} s{start}, {where}")

    def lost(self, name: str, min_speedup: float) -> str | None:
        """Why ``name`` is not worth measuring again for this model here, or None."""
        seen = self.family.get(name)
        if not seen or name == self.winner:
            return None
        if seen.get("status") in ("failed", "rejected"):
            return f"{seen['status']} for this model on this machine before (cache)"
        speedup = seen.get("speedup")
        if speedup is not None and speedup < min_speedup:
            return f"{speedup:.2f}x eager for this model on this machine before, under {min_speedup:g}x (cache)"
        return None


def _family_key(key: dict) -> dict:
    return {**{k: v for k, v in key.items() if k != "inputs"}, "record": "family"}


def _machine_key(key: dict) -> dict:
    return {**{k: v for k, v in key.items() if k not in ("inputs", "model", "strategies")},
            "model_class": "machine", "record": "machine"}


def load_priors(directory: Path, key: dict) -> Priors:
    family = compile_cache.load(directory, _family_key(key)) or {}
    machine = compile_cache.load(directory, _machine_key(key)) or {}
    return Priors(family=family.get("candidates", {}), winner=family.get("winner"), rates=machine.get("rates", {}))


def store_priors(directory: Path, key: dict, report, modules: dict, cold: str | None) -> None:
    """Record this search: each candidate's compile time and result for the model (family), and
    its seconds per compiled module for the machine, but for ``cold``, the process's first
    compile (its time holds inductor's start-up). ``modules``: name -> (scope, modules)."""
    priors = load_priors(directory, key)
    for c in report.candidates:
        if c.name == "eager" or c.status in ("pending", "skipped"):
            continue
        # compiled beside training first: its compile process's time is the cold figure; abandoned, what
        # it was expected to take
        priors.family[c.name] = {"compile_s": c.outran_s or c.background_s or c.compile_s,
                                 "speedup": report.speedup(c.name), "status": c.status}
        scope, n = modules.get(c.name, (None, 0))
        if c.status != "failed" and c.compile_s > 0 and n and c.name != cold and not c.background_s:
            priors.rates[scope] = (priors.rates.get(scope, []) + [c.compile_s / n])[-MACHINE_SAMPLES:]
    compile_cache.store(directory, _family_key(key), {"winner": report.chosen, "candidates": priors.family})
    compile_cache.store(directory, _machine_key(key), {"rates": priors.rates})
