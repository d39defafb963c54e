"""Compile strategies: what ``slipstream.compile`` measures, and how each is switched on and off.

A strategy is a row of ``STRATEGIES``: eager, or ``torch.compile`` with a mode, a shape policy
and a scope. The scope is either the whole ``forward`` or the *regions*: the repeated blocks of
the model (the layers of a ``ModuleList``/``Sequential`` of two or more modules of one class),
compiled one by one. Regions compile once for identical layers (dynamo treats a module's
parameters as inputs) and stay valid when a stack wraps the model; whole-model graphs are
larger but cut by every hook.

Modules that carry forward hooks (ZeRO-3 and FSDP2 gather parameters in them) are never
compiled themselves: the hook-free parts inside them are (``hook_free_regions``), so a wrapped
model still gets its element-wise work fused.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

__all__ = ["STRATEGIES", "Counter", "Strategy", "candidates", "floats_constant", "has_forward_hooks",
           "hook_free_regions", "not_worth", "repeated_blocks", "whole_model"]


@dataclass(frozen=True)
class Strategy:
    name: str
    """Shown in reports and stored in the cache."""
    compiled: bool = True
    scope: str = "model"
    """``"model"``: the model's ``forward``; ``"regions"``: each repeated block's."""
    mode: str | None = None
    """``torch.compile`` mode (None: inductor's default)."""
    dynamic: bool | None = None
    """``torch.compile(dynamic=)``: None is torch's default (static, then dynamic on a shape
    change); True compiles one graph for every length from the start."""
    devices: tuple = ("cpu", "cuda")
    """Device types it is a candidate on."""
    opt_in: bool = False
    """Measured only when ``CompileConfig.max_autotune`` asks (its compile time is long)."""


STRATEGIES = (
    Strategy("eager", compiled=False),
    Strategy("inductor"),
    # Static: blocks of several shapes (a ResNet's stages) share one code object, and the
    # automatic switch to dynamic shapes after their recompiles failed in inductor.
    Strategy("regions", scope="regions", dynamic=False),
    Strategy("max-autotune", mode="max-autotune-no-cudagraphs", opt_in=True),
    # CUDA graphs replay one recorded launch sequence: static shapes only.
    Strategy("cudagraphs", mode="reduce-overhead", dynamic=False, devices=("cuda",)),
    # Last: by their turn the search has seen whether the batches change shape.
    Strategy("inductor-dynamic", dynamic=True),
    Strategy("regions-dynamic", scope="regions", dynamic=True),
)


def candidates(device_type: str, *, names=None, max_autotune: bool | None = None,
               has_regions: bool = False, has_hooks: bool = False) -> list[Strategy]:
    """The strategies worth measuring for this model and device, eager first.

    ``max_autotune=None`` measures it on CUDA only (on CPU its GEMM search costs minutes).
    The dynamic variants come last; the search skips them when no batch has changed shape by
    their turn. A model whose own modules carry hooks is compiled by regions only."""
    by_name = {s.name: s for s in STRATEGIES}
    if names is not None:
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise ValueError(f"unknown compile strategy {unknown[0]!r}; known: {', '.join(by_name)}")
        return [by_name["eager"]] + [by_name[n] for n in names if n != "eager"]
    autotune = device_type == "cuda" if max_autotune is None else max_autotune
    return [s for s in STRATEGIES
            if device_type in s.devices and (autotune or not s.opt_in) and (has_regions or s.scope != "regions")
            and not (has_hooks and s.compiled and s.scope == "model")]


def whole_model(s: Strategy) -> Strategy | None:
    """The strategy compiling the whole model with regions ``s``'s mode and shape policy."""
    return next((w for w in STRATEGIES if s.scope == "regions" and w.scope == "model" and w.compiled
                 and w.mode == s.mode and bool(w.dynamic) == bool(s.dynamic)), None)


def not_worth(s: Strategy, variant: Strategy | None, varied: bool, one_graph: str | None) -> str | None:
    """Why ``s`` is not worth measuring, or None, given its dynamic ``variant`` still to come,
    whether the batches have changed shape so far, and the whole-model strategy that compiled
    the model as one graph and passed its check, or lost to eager beside training (None if none):
    - dynamic variants only when the shapes have changed; when they have, no static graph (it
      recompiles at every shape), and no default one whose dynamic variant is still to come (the
      default recompiles once, into that variant);
    - no regions once the whole model is one graph: they compile parts of it with the same
      compiler, quicker to compile but not to run, and that compile is already paid."""
    if s.dynamic:
        if not varied:
            return "batch shapes did not change"
    elif varied and s.dynamic is False:
        return "batch shapes change: a static graph recompiles at each"
    elif varied and variant is not None:
        return f"batch shapes change: measured as {variant.name}, the graph it recompiles into"
    if one_graph is not None:
        return f"{one_graph} compiled the whole model as one graph: regions of it would not run faster"
    return None


class Counter:
    """The ``torch.compile`` backend of every compiled strategy: counts and times the graphs
    inductor builds, so recompiles are seen whatever torch's logging says."""

    in_process = 0
    """Graphs built by every ``Counter`` of this process (the first pays inductor's start-up)."""

    def __init__(self, mode: str | None) -> None:
        self.mode = mode
        self.graphs = 0
        self.seconds = 0.0
        self.on_graph = None
        """Called with each graph before it compiles (a compile process's ``bounded.Progress``)."""

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        if self.on_graph is not None:
            self.on_graph(gm)
        self.graphs += 1
        Counter.in_process += 1
        start = time.perf_counter()
        try:
            # fallback_random: random ops (dropout) draw from torch's generator as eager does, so
            # a compiled step gives eager's numbers and the check can compare them (inductor's own
            # RNG made BERT's loss differ by 2e-2 with dropout 0.1).
            patches = {**list_mode_options(self.mode or "default"), "fallback_random": True}
            return compile_fx(gm, example_inputs, config_patches=patches)
        finally:
            self.seconds += time.perf_counter() - start


def has_forward_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a module inside it carries forward (pre-)hooks."""
    return any(m._forward_pre_hooks or m._forward_hooks for m in module.modules())


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of every ``ModuleList``/``Sequential`` holding two or more modules of one
    class (a transformer's layers, a ResNet stage's bottlenecks), outermost first."""
    containers = (torch.nn.ModuleList, torch.nn.Sequential)
    found, seen = [], set()
    for module in model.modules():
        if not isinstance(module, containers) or id(module) in seen:
            continue
        kids = list(module.children())
        if len(kids) >= 2 and len({type(k) for k in kids}) == 1 and not isinstance(kids[0], containers):
            found.extend(kids)
            seen.update(id(m) for k in kids for m in k.modules())
    return found


def hook_free_regions(blocks) -> list[torch.nn.Module]:
    """Each block that holds parameters, or where a block carries hooks, the largest hook-free
    modules inside it that do (so a hook never runs inside a graph)."""
    regions = []
    for block in blocks:
        if has_forward_hooks(block):
            regions.extend(hook_free_regions(block.children()))
        elif any(True for _ in block.parameters()):
            regions.append(block)
    return regions


@dataclass
class Applied:
    """A compiled strategy's callables, built once and switched on per step."""

    strategy: Strategy
    counter: Counter
    forward: object = None
    """The compiled ``forward`` (scope ``"model"``)."""
    regions: list = field(default_factory=list)
    """(module, compiled forward, the instance's own forward or None) (scope ``"regions"``);
    switched on for one call at a time, inside the autotuner's forward (its record in the
    patch registry covers them)."""

    def activate(self) -> None:
        for module, compiled, _ in self.regions:
            module.forward = compiled

    def deactivate(self) -> None:
        for module, _, previous in self.regions:
            if previous is None:
                vars(module).pop("forward", None)
            else:
                module.forward = previous


def build(strategy: Strategy, eager_forward, regions: list[torch.nn.Module]) -> Applied:
    """Compile ``strategy`` lazily (``torch.compile`` compiles at the first call)."""
    counter = Counter(strategy.mode)
    applied = Applied(strategy, counter)

    def compiled(forward):
        fn = torch.compile(forward, backend=counter, dynamic=strategy.dynamic)
        return floats_constant(fn) if strategy.dynamic else fn

    if strategy.scope == "model":
        applied.forward = compiled(eager_forward)
    else:
        for module in regions:  # a forward another library set on the instance is compiled with it
            previous = vars(module).get("forward")
            applied.regions.append((module, compiled(module.forward), previous))
    return applied


def floats_constant(fn):
    """``fn``, traced with the Python floats it reads as constants (``specialize_float``).

    Under ``dynamic=True`` dynamo makes every float symbolic, then specializes those a kernel
    cannot take and starts the trace again: the whole graph traced and AOT-compiled twice.
    llama-20m varlen (an embedding's ``norm_type``), 2 cores with a test run beside: 91 s to
    compile cold, 53 s with floats as constants; from inductor's cache on another batch, 17 s
    against 6.4 s. A model's floats (a scale, an epsilon) stay the same from step to step; one
    that changes is guarded, and recompiles."""

    @functools.wraps(fn)
    def forward(*args, **kwargs):
        with torch._dynamo.config.patch(specialize_float=True):
            return fn(*args, **kwargs)
    return forward
