"""The settings of ``slipstream.compile`` and what it reports (see ``autotune``)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field

from ..._common.settings import Settings
from . import strategy

__all__ = ["Candidate", "CompileConfig", "CompileFallbackWarning", "CompileReport"]


class CompileFallbackWarning(UserWarning):
    """A compiled module went back to eager during the run; the message says why."""


@dataclass(kw_only=True, frozen=True)
class CompileConfig(Settings):
    enabled: bool = True
    """False: the model runs as it is (the stacks' ``"compile": {"enabled": false}``)."""
    strategies: tuple | None = None
    """Names from ``strategy.STRATEGIES`` to measure besides eager; None: all that apply."""
    strategy: str | None = None
    """Skip the search and use this strategy (still checked against eager at the first step,
    still put back on eager on any failure)."""
    expected_steps: int | None = None
    """Steps in the whole run, a step being one call of the model's forward (with gradient
    accumulation, each micro-batch's). The stacks fill it in when they know it (``finetune
    --steps``, Megatron's ``--train-iters``, DeepSpeed's scheduler ``total_num_steps``, the
    Hugging Face Trainer's ``max_steps``), times their micro-batches per optimizer step; with
    it the search costs at most ``budget_share`` of the run (``budget``)."""
    budget_share: float = 0.05
    """Share of the run (``expected_steps`` x eager's step time) the search may cost."""
    budget_s: float = 600.0
    """Most seconds the search may cost, whatever the run's length (the budget when it is not
    known). A candidate whose expected compile time does not fit in what is left is skipped."""
    background: bool | None = None
    """Compile a candidate first in a process of its own while training goes on eagerly; its
    compile in the training process then loads the kernels from inductor's cache
    (``background``). True: every candidate; None: on a model on the CPU, a candidate where
    that is expected to cost training less than compiling it in the training process (off on
    CUDA, where the copy would take device memory); False: never."""
    warmup_steps: int = 1
    """Untimed steps of each candidate after its check (a first shape change recompiles)."""
    measure_rounds: int = 5
    """Timed steps per surviving candidate, taken in turns; the median is compared."""
    min_speedup: float = 1.05
    """A compiled strategy is kept only if its median step beats eager's by this factor."""
    max_recompiles: int = 8
    """New graphs after the choice beyond this mean a recompile storm: back to eager."""
    check_every: int = 500
    """Steps between checks of the chosen strategy against eager after the choice (0: never)."""
    max_autotune: bool | None = None
    """Measure ``max-autotune-no-cudagraphs``: None means on CUDA only (slow to compile on CPU)."""
    graph_breaks: bool = True
    """List graph breaks on the first batch (``torch._dynamo.explain``)."""
    cache: bool = True
    """Read and write the decision cache."""
    cache_dir: str | None = None
    """Where the cache lives; None: ``compile_cache.default_dir()``."""
    verbose: bool = True
    """Print the report at the choice (rank 0)."""

    def __post_init__(self) -> None:
        if self.budget_s <= 0:
            raise ValueError(f"budget_s must be > 0, got {self.budget_s}")
        if not 0 < self.budget_share <= 1:
            raise ValueError(f"budget_share must be in (0, 1], got {self.budget_share}")
        if self.expected_steps is not None and not _whole(self.expected_steps):
            raise ValueError(f"expected_steps must be a whole number >= 1 or None, got {self.expected_steps!r}")
        for name in ("warmup_steps", "max_recompiles", "check_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.measure_rounds < 1:
            raise ValueError(f"measure_rounds must be >= 1, got {self.measure_rounds}")
        if self.min_speedup < 1.0:
            raise ValueError("min_speedup must be >= 1.0 (a compiled strategy slower than eager is never kept), "
                             f"got {self.min_speedup}")
        if self.strategy is not None:
            strategy.candidates("cpu", names=(self.strategy,))
        if self.strategies is not None:
            object.__setattr__(self, "strategies", tuple(self.strategies))
            strategy.candidates("cpu", names=self.strategies)  # unknown names refused here

    def with_run_length(self, steps, micro_batches=1) -> "CompileConfig":
        """This config with ``expected_steps`` set to ``steps`` (the stack's run length in
        optimizer steps) times ``micro_batches`` (forward calls per optimizer step: gradient
        accumulation, pipeline micro-batches) when the user set none and both are whole numbers
        >= 1; else this config."""
        if self.expected_steps is not None or not (_whole(steps) and _whole(micro_batches)):
            return self
        return dataclasses.replace(self, expected_steps=steps * micro_batches)


def _whole(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


@dataclass
class Candidate:
    name: str
    status: str = "pending"
    """pending | measured | chosen | rejected | skipped | failed | abandoned (its compile process
    outran its share of the budget, or failed while searching kernels: ``bounded``)"""
    reason: str = ""
    compile_s: float = 0.0
    graphs: int = 0
    step_s: list = field(default_factory=list)
    """Timed steps, seconds per element of the batch."""
    raw_s: list = field(default_factory=list)
    """Timed steps, seconds."""
    background_s: float | None = None
    """Seconds its compile process took, when it was compiled beside training first."""
    beside: str = ""
    """How it was compiled beside training, or why it was not."""
    outran_s: float | None = None
    """Where it was abandoned for outrunning its share: the seconds its compile was expected to
    take (those its process ran, or more where its kernel search's first shapes foretold more)."""
    score: float | None = None
    """What the choice compared: the median of ``step_s``, averaged over the ranks."""

    def median(self) -> float:
        return statistics.median(self.step_s) if self.step_s else float("inf")

    def compared(self) -> float:
        return self.score if self.score is not None else self.median()


@dataclass
class CompileReport:
    module: str
    chosen: str = "eager"
    from_cache: bool = False
    decided_at_step: int | None = None
    candidates: list = field(default_factory=list)
    graph_count: int | None = None
    graph_breaks: list = field(default_factory=list)
    recompiles: int = 0
    recompile_reasons: list = field(default_factory=list)
    search_s: float = 0.0
    search_steps: int = 0
    fallback: str | None = None
    cache_file: str | None = None
    units: list = field(default_factory=list)
    """Elements of each timed step's batch."""
    expected_steps: int | None = None
    budget_s: float | None = None
    """What the search could cost (``budget.search_budget``), and ``budget_basis`` how it was set."""
    budget_basis: str = ""
    background: str | None = None
    """Why candidates were not compiled beside training; None when they were."""
    eager_step_s: float | None = None
    """Eager's seconds per step: its median in the timed rounds, else the faster of the run's
    second and third steps."""

    def step_ms(self, name: str) -> float | None:
        """``name``'s median step time per element (the ranks' mean), scaled to the median
        timed batch of this rank."""
        by = {c.name: c for c in self.candidates}
        if name not in by or not by[name].step_s:
            return None
        return by[name].compared() * statistics.median(self.units) * 1e3

    def speedup(self, name: str) -> float | None:
        by = {c.name: c for c in self.candidates}
        if name not in by or "eager" not in by or not by[name].step_s or not by["eager"].step_s:
            return None
        return by["eager"].compared() / by[name].compared()

    def overhead_s(self) -> float:
        """What the search cost: its time beyond what the same steps take eagerly."""
        return max(self.search_s - self.search_steps * (self.eager_step_s or 0.0), 0.0)

    def chosen_step_s(self) -> float | None:
        """The chosen strategy's seconds per step in the timed rounds (eager's if it is eager)."""
        by = {c.name: c for c in self.candidates}
        chosen = by.get(self.chosen)
        if self.chosen == "eager" or chosen is None or not chosen.raw_s:
            return self.eager_step_s
        return statistics.median(chosen.raw_s)

    def break_even_step(self) -> int | None:
        """The step by which the chosen strategy's faster steps have paid for the search; None
        when they never do (eager chosen after a search that cost anything) or nothing is known."""
        chosen, eager = self.chosen_step_s(), self.eager_step_s
        if self.decided_at_step is None or chosen is None or eager is None:
            return None
        cost = self.overhead_s()
        if cost == 0:
            return self.decided_at_step
        return self.decided_at_step + math.ceil(cost / (eager - chosen)) if chosen < eager else None

    def cost_line(self) -> str:
        """What the search cost against its budget, and what it earns over the run."""
        budget = f" of a {self.budget_s:.1f} s budget ({self.budget_basis})" if self.budget_s is not None else ""
        line = f"search cost {self.overhead_s():.1f} s{budget}"
        even = self.break_even_step()
        if self.chosen != "eager" and even is not None:
            line += f"; pays for itself at step {even}"
            if self.expected_steps:
                line += f" of {self.expected_steps}" + (" (not within the run)" if even > self.expected_steps else "")
        elif self.overhead_s() > 0:
            line += "; not earned back (eager chosen)" if self.chosen == "eager" else "; not earned back"
        return line

    def table(self) -> str:
        head = f"slipstream.compile {self.module}: " + (
            f"{self.chosen} (from the cache {self.cache_file}; no search)" if self.from_cache
            else f"{self.chosen}, chosen at step {self.decided_at_step} after a {self.search_s:.1f} s search "
                 f"({self.overhead_s():.1f} s more than {self.search_steps} steps of eager)")
        rows = ["| strategy | status | step ms | vs eager | compile s | graphs | note |",
                "|---|---|---:|---:|---:|---:|---|"]
        for c in self.candidates:
            ms = f"{self.step_ms(c.name):.1f}" if c.step_s else "-"
            sp = self.speedup(c.name)
            rows.append(f"| {c.name} | {c.status} | {ms} | {f'{sp:.2f}x' if sp else '-'} | {c.compile_s:.1f} "
                        f"| {c.graphs} | {'; '.join(filter(None, (c.reason, c.beside)))} |")
        beside = "on" if self.background is None else self.background
        lines = [head, f"{self.cost_line()}; compiled beside training: {beside}", *rows]
        if self.graph_count is not None:
            lines.append(f"graphs per step: {self.graph_count}; graph breaks: {len(self.graph_breaks)}")
            lines += [f"  - {b.where}: {b.reason}" for b in self.graph_breaks[:10]]
        lines.append(f"new graphs after the choice: {self.recompiles}; "
                     f"guards that failed: {len(self.recompile_reasons)}")
        lines += [f"  - {r}" for r in self.recompile_reasons[:10]]
        if self.fallback:
            lines.append(f"fallback to eager: {self.fallback}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "module": self.module, "chosen": self.chosen, "from_cache": self.from_cache,
            "decided_at_step": self.decided_at_step, "search_s": self.search_s, "search_steps": self.search_steps,
            "overhead_s": self.overhead_s(), "fallback": self.fallback, "cache_file": self.cache_file,
            "expected_steps": self.expected_steps, "budget_s": self.budget_s, "budget_basis": self.budget_basis,
            "background": self.background, "eager_step_s": self.eager_step_s, "chosen_step_s": self.chosen_step_s(),
            "break_even_step": self.break_even_step(),
            "graph_count": self.graph_count,
            "graph_breaks": [{"reason": b.reason, "where": b.where} for b in self.graph_breaks],
            "recompiles": self.recompiles, "recompile_reasons": list(self.recompile_reasons),
            "candidates": [{"name": c.name, "status": c.status, "reason": c.reason, "compile_s": c.compile_s,
                            "background_s": c.background_s, "beside": c.beside, "outran_s": c.outran_s,
                            "graphs": c.graphs,
                            "step_ms": self.step_ms(c.name),
                            "speedup": self.speedup(c.name)} for c in self.candidates],
        }
