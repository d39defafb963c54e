"""``slipstream.compile`` and its undo: the model's ``forward`` becomes an ``Autotuner``
(``autotuner``), an instance attribute that ``uncompile`` removes."""

from __future__ import annotations

import contextlib
import inspect
import weakref

import torch

from ..._common.patch import change, forget
from .autotuner import MARKER, Autotuner
from .config import CompileConfig, CompileReport

__all__ = ["compile", "compile_report", "is_compiled", "tell_run_length", "uncompile"]


def _target(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward is tuned: DDP's inner module, else the model itself."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model

def compile(model: torch.nn.Module, example=None, *, config: CompileConfig | None = None,
            group=None) -> torch.nn.Module:
    """Tune ``model``'s forward by measurement on its first training steps (module docstring).

    Returns ``model`` itself, its ``forward`` replaced (state dict and parameters unchanged).
    ``model`` may be DDP-wrapped (its inner module is tuned), an FSDP2 or DeepSpeed module (the
    hook-free regions are compiled). ``example``: a batch (a tuple of arguments or a dict of
    keyword arguments) to list graph breaks with now, before training. ``group``: the process
    group whose ranks agree on the choice (None: the world, when initialised). Idempotent."""
    config = CompileConfig() if config is None else config
    if not isinstance(config, CompileConfig):
        raise TypeError(f"config must be a CompileConfig, got {type(config).__name__}")
    module = _target(model)
    if not config.enabled or is_compiled(module):
        return model
    tuner = Autotuner(module, config, group)
    if example is not None and config.graph_breaks:
        if isinstance(example, dict):
            args, kwargs = (), dict(example)
        else:
            args, kwargs = tuple(example) if isinstance(example, (tuple, list)) else (example,), {}
        tuner._graph_breaks(args, kwargs)
    with contextlib.suppress(TypeError, ValueError):  # a forward without one keeps the tuner's own
        # inspect.signature(model.forward) stays the model's: the Hugging Face Trainer keeps the
        # batch's columns that the forward names, and would drop them all for (*args, **kwargs)
        tuner.__signature__ = inspect.signature(tuner.eager)
    module.forward = tuner
    ref = weakref.ref(module)
    change(("compile", id(module)), f"{type(module).__name__}.forward: slipstream.compile's autotuner",
           lambda: ref() is not None and uncompile(ref()), owner="compile", target=module)
    return model


def is_compiled(model: torch.nn.Module) -> bool:
    return getattr(vars(_target(model)).get("forward"), MARKER, False)


def compile_report(model: torch.nn.Module) -> CompileReport | None:
    """What ``compile`` measured and chose for ``model`` (None if it was not compiled)."""
    tuner = vars(_target(model)).get("forward")
    return tuner.report if getattr(tuner, MARKER, False) else None


def tell_run_length(model: torch.nn.Module, steps, micro_batches=1) -> int:
    """Give the autotuners in ``model`` (its modules') the run's length, ``steps`` optimizer
    steps of ``micro_batches`` forward calls (``CompileConfig.with_run_length``), where neither
    the user nor a stack set one and the autotuner has not taken its first step. For a stack
    that knows the run's length only after the model was compiled (the Hugging Face Trainer).
    Returns how many were told."""
    told = 0
    for module in model.modules():
        tuner = vars(module).get("forward")
        if getattr(tuner, MARKER, False) and tuner.phase == "start" and tuner.config.expected_steps is None:
            tuner.config = tuner.config.with_run_length(steps, micro_batches)
            told += tuner.config.expected_steps is not None
    return told


def uncompile(model: torch.nn.Module) -> None:
    """Undo ``compile``: the model's forward is what it was before (no-op if not compiled)."""
    module = _target(model)
    tuner = vars(module).get("forward")
    if not getattr(tuner, MARKER, False):
        return
    forget(("compile", id(module)))
    for applied in tuner.built.values():
        applied.deactivate()
    if tuner.previous is None:
        del module.forward
    else:
        module.forward = tuner.previous
