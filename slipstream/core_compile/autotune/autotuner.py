"""The ``Autotuner``: the compile strategy chosen by measurement on the first real steps.

The model's ``forward`` becomes an ``Autotuner`` (``api.compile``). Each call is one training
step; the time between two calls is the step's time, backward and optimizer included. The
search, on the user's own batches, at a cost bounded by ``budget`` (a share of the run when
its length is known):

1. the first step runs eagerly; with ``expected_steps``, the second and third too, timed:
   eager's step time sets the budget. Strategies that lost for this model here before are
   skipped and its last winner goes first (``budget.Priors``, when every rank read the same);
2. then (by then it is known whether the batches change shape: if they do, static graphs are
   skipped and the default shape policy is measured as its dynamic variant) each candidate
   (``strategy.candidates``) whose expected compile time fits in what is left of the budget is
   compiled (the graph breaks are listed before the first; regions are skipped once the whole model
   compiled as one graph), checked against eager on the step's batch (``check.compare``: loss and
   gradients), then runs ``warmup_steps`` steps. On the CPU (``background``) a process of its own
   compiles and times it first while the steps run eagerly: one that lost there, or cannot pay for
   itself in the steps left (``budget.cannot_pay``), is not compiled here; the others' compile here
   loads inductor's kernels from the cache. A kernel search (max-autotune) runs only in such a
   process, waited for if not beside training; one that outruns its share of the budget is killed
   and its candidate abandoned (``bounded``);
3. the survivors, eager included, take turns for up to ``measure_rounds`` rounds of timed
   steps (interleaved, so a slow spell hits all; a switch's first step is untimed); each step's time is
   divided by its batch's elements (lengths vary). From round two, a candidate the steps so far
   decide against is not timed further, and the search stops as soon as the rest is decided
   (``_prune``); the fastest median wins if it beats eager by ``min_speedup``, else eager does.
   Under ``torch.distributed`` the ranks agree on every choice (one all-reduce per decision),
   so they compile and stop alike.

After the choice, any error in a compiled call, more than ``max_recompiles`` new graphs, or a
mismatch at a periodic check (``check_every``) puts the model back on eager for good, with one
warning saying why; the failing step is rerun eagerly, so the run goes on with eager numbers.
The choice is cached on disk (``cache``); a run with the same model, shapes, device and
versions skips the search and says so.
"""
from __future__ import annotations

import statistics
import sys
import time
import warnings
from collections import deque
from pathlib import Path

import torch

from . import background, budget, cache as compile_cache, check, diagnose, strategy
from .agree import agree, rank
from .config import Candidate, CompileConfig, CompileFallbackWarning, CompileReport

__all__ = ["MARKER", "Autotuner"]

MARKER = "_slipstream_autotuner"
# Dynamo counts every compiled variant of a code object against one limit (8), and the
# candidates share the model's code objects: measured strategies must not crowd each other out.
_RECOMPILE_LIMIT = 64
# a candidate whose fastest timed step is this many times eager's is not timed further
PRUNE_FACTOR = 2.0


class Autotuner:
    """The tuned module's ``forward``: measures, then runs the chosen strategy (see the module
    docstring). One call is one step."""

    def __init__(self, module: torch.nn.Module, config: CompileConfig, group) -> None:
        self.module, self.config, self.group = module, config, group
        self.previous = vars(module).get("forward")  # someone else's wrapper, kept and restored
        self.eager = module.forward
        self.report = CompileReport(module=type(module).__name__)
        self.phase = "start"
        self.step = 0
        self.by_name: dict[str, Candidate] = {}
        self.built: dict[str, strategy.Applied] = {}
        self.pending: deque = deque()
        self.survivors: list[str] = []
        self.warm_left = 0
        self.active: str = "eager"
        self.last = "eager"  # the strategy of the search's last step
        self.timed: tuple | None = None  # (name, start, units) of the step being timed
        self.search_start = 0.0
        self.first_signature = None
        self.shapes_vary = False
        self.graphs_at_choice = 0
        self.regions: list = []
        self.hooked = False  # set at the first step: a stack may wrap the model after compile()
        self.key: dict | None = None
        self.priors = budget.Priors()
        self.modules: dict[str, tuple] = {}  # name -> (scope, modules it compiles)
        self.budget, self.left = None, 0.0  # what the search may cost, and what was left at the last candidate
        self.probe: float | None = None  # start of an eager step that times eager before the search
        self.cold: str | None = None  # the candidate compiled first in this process
        self.listed = False
        self.background: str | None = None  # why no candidate may be compiled beside training; None: they may
        self.prebuilds = background.Prebuilds(group, module, self.previous,  # candidates compiled beside training
                                              config.min_speedup if config.strategies is None else None)
        setattr(self, MARKER, True)

    # ------------------------------------------------------------------ the step
    def __call__(self, *args, **kwargs):
        now = time.perf_counter()
        if self.timed is not None:
            name, start, units = self.timed
            self.by_name[name].raw_s.append(now - start)
            self.by_name[name].step_s.append((now - start) / units)
            self.report.units.append(units)
            self.timed = None
        if self.probe is not None:  # the faster of two eager steps (a varlen batch's length varies)
            took, self.probe = now - self.probe, None
            self.report.eager_step_s = min(took, self.report.eager_step_s or took)
        self.step += 1
        if self.phase == "start":
            self.search_start = now
            self._start(args, kwargs)
        if self.phase == "search":
            return self._search_step(now, args, kwargs)
        if self.phase == "verify":
            self._verify_cached(args, kwargs)
        return self._run_chosen(args, kwargs)

    # ------------------------------------------------------------------ set-up
    def _start(self, args, kwargs) -> None:
        self.first_signature = compile_cache.signature([args, kwargs])
        first = check._first_tensor(list(args) + list(kwargs.values()))
        params = (p.device for p in self.module.parameters())
        device = self.prebuilds.device = first.device if first is not None else next(params, torch.device("cpu"))
        self.hooked = strategy.has_forward_hooks(self.module)
        self.regions = strategy.hook_free_regions(strategy.repeated_blocks(self.module))
        if self.config.cache:
            self.key = compile_cache.cache_key(self.module, args, kwargs, device,
                                               {"strategies": list(self.config.strategies or ())})
            entry = compile_cache.load(self._cache_dir(), self.key)
            if entry and entry.get("chosen") in {s.name for s in strategy.STRATEGIES}:
                self.report.from_cache = True
                self.report.cache_file = str(compile_cache._path(self._cache_dir(), self.key))
                self._choose(entry["chosen"], verify=True)
                self._say()
                return
        if self.config.strategy is not None:
            self._choose(self.config.strategy, verify=True)
            self.by_name[self.config.strategy].reason = "named by CompileConfig.strategy: no search"
            return
        self.report.expected_steps = self.config.expected_steps
        self.background = self.report.background = background.wanted(self.config.background, self.module, device,
                                                                        self.group)
        for s in strategy.candidates(device.type, names=self.config.strategies, max_autotune=self.config.max_autotune,
                                     has_regions=bool(self.regions), has_hooks=self.hooked):
            self.by_name[s.name] = Candidate(s.name)
            if s.compiled:
                self.pending.append(s)
                self.modules[s.name] = (s.scope, budget.compiled_modules(self.module, s, self.regions))
        self.report.candidates = list(self.by_name.values())
        self._apply_priors()
        self.by_name["eager"].status = "measured"
        self.survivors = ["eager"]
        self.phase = "search"

    def _apply_priors(self) -> None:
        """Skip what lost for this model here before; measure its last winner first. Only when
        every rank read the same priors (one all-reduce), so that the ranks search alike."""
        if self.key is None:
            return
        priors = budget.load_priors(self._cache_dir(), self.key)
        names = [s.name for s in self.pending]
        lost = [priors.lost(n, self.config.min_speedup) for n in names]
        mine = [float(why is not None) for why in lost] + [float(n == priors.winner) for n in names]
        agreed = agree(self.group, mine + [-v for v in mine])
        if agreed[:len(mine)] != [-v for v in agreed[len(mine):]]:
            return  # the ranks' caches differ: no priors, the full search
        self.priors = priors
        for s, why in zip(list(self.pending), lost):
            if why:
                self.pending.remove(s)
                self.by_name[s.name].status, self.by_name[s.name].reason = "skipped", why
            elif s.name == priors.winner:
                self.pending.remove(s)
                self.pending.appendleft(s)
                self.by_name[s.name].reason = "the last winner for this model here (cache): measured first"

    def _graph_breaks(self, args, kwargs) -> None:
        self.report.graph_count, self.report.graph_breaks = diagnose.list_breaks(self.module, self.eager, args, kwargs)

    def _list_breaks(self, args, kwargs) -> None:
        """List the graph breaks here, unless compile()'s example did, or a compile process did
        beside training (the node's first rank's; the ranks agree)."""
        beside = self.prebuilds.listing
        if agree(self.group, [float(beside is not None)])[0]:
            if beside is not None:
                self.report.graph_count, self.report.graph_breaks = beside
        elif self.report.graph_count is None:
            self._graph_breaks(args, kwargs)

    def _cache_dir(self) -> Path:
        return Path(self.config.cache_dir) if self.config.cache_dir else compile_cache.default_dir()

    # ------------------------------------------------------------------ search
    def _search_step(self, now, args, kwargs):
        self.shapes_vary |= compile_cache.signature([args, kwargs]) != self.first_signature
        if self.warm_left > 0:
            self.warm_left -= 1
            return self._call(self.active, args, kwargs)
        if self.step == 1 and self.pending:  # the first candidate waits a step: has the shape changed by then?
            return self._call("eager", args, kwargs)
        if self.step in (2, 3) and self.pending and (self.config.expected_steps or self.background is None):
            # eager's step, for the budget and the search's cost (beside training, none may be timed in rounds)
            self.probe = now
            return self._call("eager", args, kwargs)
        while self.pending:
            s = self.pending.popleft()
            cand = self.by_name[s.name]
            why = self._skip(s) or self.prebuilds.unbounded(s) or self._over_budget(s)
            if why:
                cand.status, cand.reason = "skipped", why
                self.prebuilds.abandon(cand, s.name)  # where its compile process runs beside training
                continue
            unlisted = self.config.graph_breaks and not self.listed  # listed once a compile is worth its cost
            if s.name in self.prebuilds.beside and not self.prebuilds.ready(
                    cand, s, args, kwargs, self.left, unlisted and self.report.graph_count is None):
                if cand.status == "abandoned":  # outran its share: the search goes on without it
                    continue
                self.pending.appendleft(s)
                if s.name in self.prebuilds.beside:  # compiling beside training: eager steps meanwhile
                    return self._call("eager", args, kwargs)
                continue  # it failed there: weighed again at its cost here
            if unlisted:
                self.listed = True
                self._list_breaks(args, kwargs)
            why = self.prebuilds.lost.get(s.name) or budget.cannot_pay(  # timed beside training
                self.prebuilds.timed.get(s.name), self.config.expected_steps, self.step, self.report.eager_step_s)
            if why:
                cand.status, cand.reason = "skipped", why
                continue
            ok = self._try(s, args, kwargs)
            if agree(self.group, [0.0 if ok else 1.0])[0] == 0.0:
                self.survivors.append(s.name)
                self.warm_left = self.config.warmup_steps
                self.active = s.name
                return self._call(s.name, args, kwargs)
            if ok:  # it passed here but failed on another rank
                cand.status, cand.reason = "rejected", "failed its check on another rank"
            self.built.pop(s.name, None)
        timed = [n for n in self.survivors if len(self.by_name[n].step_s) < self.config.measure_rounds]
        decided = False
        if timed and len(timed) == len(self.survivors) and len(self.survivors) > 1:
            decided = self._prune()  # a round is complete
            timed = [n for n in timed if n in self.survivors]
        if decided or not timed or len(self.survivors) == 1:
            self._decide()
            return self._run_chosen(args, kwargs)
        name = min(timed, key=lambda n: (len(self.by_name[n].step_s), n != self.last))
        if name != self.last:  # a switch's first step pays for it (BERT-mini: eager's after a compiled one, +4%)
            return self._call(name, args, kwargs)
        self.timed = (name, now, check.units(args, kwargs))
        return self._call(name, args, kwargs)

    def _skip(self, s: strategy.Strategy) -> str | None:
        """Why ``s`` is not worth measuring (``strategy.not_worth``), or None. The ranks agree on
        whether the batches have changed shape so far, and on whether the model is one graph
        (once the whole-model candidate passed its check, or lost beside training): the graph
        breaks listed (with ranks on a node, only the one that listed them knows), else its graphs."""
        if self.config.strategies is not None:
            return None  # named by the user: measured
        variant = next((p for p in self.pending if p.dynamic and (p.scope, p.mode) == (s.scope, s.mode)), None)
        varied = bool((s.dynamic is not None or variant) and agree(self.group, [float(self.shapes_vary)])[0])
        whole = self.by_name.get(getattr(strategy.whole_model(s), "name", None))
        one_graph = False
        if whole is not None and (whole.status == "measured" or whole.name in self.prebuilds.lost):
            count = self.report.graph_count
            known, split, graphs = agree(self.group, [float(count is not None), float(count not in (None, 1)),
                                                      float(whole.graphs != 1)])
            one_graph = not (split if known else graphs)
        return strategy.not_worth(s, variant, varied, whole.name if one_graph else None)

    def _over_budget(self, s: strategy.Strategy) -> str | None:
        """Why ``s`` is not compiled: its expected compile time does not fit in what is left of
        the budget (``left``; the ranks agree on the most any of them has spent and expects)."""
        if self.budget is None:
            self.report.eager_step_s = agree(self.group, [self.report.eager_step_s or 0.0], mean=True)[0] or None
            self.budget, self.report.budget_basis = budget.search_budget(self.config, self.report.eager_step_s)
            self.report.budget_s = self.budget
        expected, source = self.prebuilds.cost(s, self.priors, self.modules[s.name][1],
                                               False if self.background else self.config.background)
        elapsed = time.perf_counter() - self.search_start
        spent, expected = agree(self.group, [elapsed - (self.step - 1) * (self.report.eager_step_s or 0.0), expected])
        self.left = self.budget - max(spent, 0.0)  # the share of a compile process started now
        if expected <= self.left:
            return None
        return (f"expected compile {expected:.3g} s ({source}); {max(self.left, 0.0):.3g} s of the "
                f"{self.budget:.3g} s budget left")

    def _try(self, s: strategy.Strategy, args, kwargs) -> bool:
        """Compile ``s`` and check it against eager on this batch."""
        cand = self.by_name[s.name]
        if strategy.Counter.in_process == 0 and self.cold is None:
            self.cold = s.name
        start = time.perf_counter()
        try:
            applied = self.built[s.name] = strategy.build(s, self.eager, self.regions)
            self._check(s.name, args, kwargs)
        except check.Mismatch as e:
            cand.status, cand.reason = "rejected", f"mismatch: {e}"
            return False
        except Exception as e:  # noqa: BLE001 - a candidate that cannot compile is not chosen
            cand.status, cand.reason = "failed", diagnose.one_line(e)
            return False
        finally:
            cand.compile_s = time.perf_counter() - start
        cand.graphs = applied.counter.graphs
        cand.status = "measured"
        return True

    def _prune(self) -> bool:
        """After two or more complete rounds of timed steps (one step may have recompiled for a
        new shape), stop timing each candidate the steps so far decide against: its fastest step
        over ``PRUNE_FACTOR`` times eager's fastest, or not ``min_speedup`` times faster than
        eager's slowest (its median cannot win). Returns True when the rest is decided too: one
        candidate's slowest step is ``min_speedup`` times faster than eager's fastest and faster
        than every other's fastest. The ranks agree on the mean of each figure."""
        rounds = len(self.by_name["eager"].step_s)
        if rounds < 2 or any(len(self.by_name[n].step_s) != rounds for n in self.survivors):
            return False
        n = len(self.survivors)
        agreed = agree(self.group, [min(self.by_name[k].step_s) for k in self.survivors]
                       + [max(self.by_name[k].step_s) for k in self.survivors], mean=True)
        fastest, slowest = dict(zip(self.survivors, agreed[:n])), dict(zip(self.survivors, agreed[n:]))
        margin, steps = self.config.min_speedup, f"{rounds} timed steps"
        for name in [k for k in self.survivors if k != "eager"]:
            if fastest[name] > PRUNE_FACTOR * fastest["eager"]:
                why = f"{fastest[name] / fastest['eager']:.1f}x eager's step time after {steps}: not timed further"
            elif fastest[name] * margin >= slowest["eager"]:
                why = f"after {steps} its fastest is not {margin:g}x faster than eager's slowest: it cannot win"
            else:
                continue
            self.survivors.remove(name)
            self.by_name[name].reason = why
            self.built.pop(name).deactivate()
        left = [k for k in self.survivors if k != "eager"]
        if not left:
            return False
        lead = min(left, key=lambda k: slowest[k])
        return slowest[lead] * margin < fastest["eager"] and all(slowest[lead] < fastest[k] for k in left if k != lead)

    def _decide(self) -> None:
        names = [c.name for c in self.report.candidates]
        medians = [self.by_name[n].median() for n in names]  # infinite where never timed
        agreed = agree(self.group, medians, mean=True)  # every rank decides on the ranks' mean
        for n, score in zip(names, agreed):
            self.by_name[n].score = score
        eager = agreed[names.index("eager")]
        best = min((i for i, n in enumerate(names) if n in self.survivors), key=lambda i: agreed[i])
        chosen = names[best] if agreed[best] * self.config.min_speedup < eager else "eager"
        if chosen == "eager" and names[best] != "eager":
            self.by_name["eager"].reason = f"no candidate beat eager by {self.config.min_speedup:g}x"
        self.report.search_s = time.perf_counter() - self.search_start
        self.report.search_steps = self.step - 1
        if self.by_name["eager"].raw_s:
            self.report.eager_step_s = statistics.median(self.by_name["eager"].raw_s)
        self._choose(chosen)
        if self.key is not None:
            path = compile_cache.store(self._cache_dir(), self.key, {"chosen": chosen, "report": self.report.to_dict()})
            self.report.cache_file = str(path) if path else None
            budget.store_priors(self._cache_dir(), self.key, self.report, self.modules, self.cold)
        self._say()

    def _say(self) -> None:
        if self.config.verbose and rank() == 0:
            print(self.report.table(), file=sys.stderr, flush=True)

    def _choose(self, name: str, verify: bool = False) -> None:
        """``name`` runs from now on; ``verify``: checked against eager at its first step."""
        if name not in self.by_name:
            self.by_name[name] = Candidate(name)
            self.report.candidates.append(self.by_name[name])
        self.prebuilds.stop()
        for n, applied in list(self.built.items()):
            if n != name:
                applied.deactivate()
                del self.built[n]
        self.by_name[name].status = "chosen"
        self.active = name
        self.report.chosen = name
        self.report.decided_at_step = self.step
        self.phase = "verify" if verify and name != "eager" else "chosen"
        if name != "eager" and name not in self.built:
            s = next(s for s in strategy.STRATEGIES if s.name == name)
            self.built[name] = strategy.build(s, self.eager, self.regions)
        self.graphs_at_choice = self.built[name].counter.graphs if name in self.built else 0

    # ------------------------------------------------------------------ after the choice
    def _verify_cached(self, args, kwargs) -> None:
        self.phase = "chosen"
        start = time.perf_counter()
        try:
            self._check(self.active, args, kwargs)
            self.by_name[self.active].compile_s = time.perf_counter() - start
        except Exception as e:  # noqa: BLE001
            self._fall_back(f"{self.active!r} ({'cached' if self.report.from_cache else 'named'}) failed its check "
                            f"against eager: {diagnose.one_line(e)}")
        self.graphs_at_choice = self.built[self.active].counter.graphs if self.active in self.built else 0

    def _run_chosen(self, args, kwargs):
        name = self.active
        if name == "eager":
            return self.eager(*args, **kwargs)
        every = self.config.check_every
        try:
            if every and self.step % every == 0:
                self._check(name, args, kwargs)
            out = self._call(name, args, kwargs)
        except Exception as e:  # noqa: BLE001 - rerun eagerly: eager's own error, if any, is the user's
            return self._fall_back(f"step {self.step}: {diagnose.one_line(e)}", args, kwargs)
        self.by_name[name].graphs = self.built[name].counter.graphs
        new = self.built[name].counter.graphs - self.graphs_at_choice
        self.report.recompiles = new
        if new > self.config.max_recompiles:
            why = "; ".join(self.report.recompile_reasons[-3:]) or "no guard reported"
            self._fall_back(f"recompile storm: {new} new graphs after the choice "
                            f"(max_recompiles={self.config.max_recompiles}); last guards: {why}")
        return out

    def _fall_back(self, reason: str, args=None, kwargs=None):
        applied = self.built.pop(self.active, None)
        if applied is not None:
            applied.deactivate()
        self.report.fallback = reason
        self.active = "eager"
        warnings.warn(f"slipstream.compile: {self.report.module} runs eagerly from now on: {reason}",
                      CompileFallbackWarning, stacklevel=3)
        return self.eager(*args, **kwargs) if args is not None else None

    # ------------------------------------------------------------------ helpers
    def _call(self, name: str, args, kwargs):
        """One step of ``name``: its regions switched on (they compile inside the eager forward),
        dynamo's limit raised and recompiles watched."""
        self.last = name
        if name == "eager":
            return self.eager(*args, **kwargs)
        applied = self.built[name]
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT), \
                diagnose.watch_recompiles(self.report.recompile_reasons):
            applied.activate()
            try:
                return (applied.forward or self.eager)(*args, **kwargs)
            finally:
                applied.deactivate()

    def _check(self, name: str, args, kwargs) -> None:
        """``check.compare`` of ``name`` against eager on this batch (raises on a mismatch); the
        loss only where the model's modules carry hooks (``check.compare``)."""
        check.compare(self.module, self.eager, lambda *a, **k: self._call(name, a, k), args, kwargs,
                      gradients=not self.hooked)
