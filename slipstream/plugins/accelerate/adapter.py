"""accelerate + FSDP2 through the core, with the script and the accelerate YAML users have
(docs/fsdp.md). Installed when accelerate is imported after ``slipstream.enable()``;
``slipstream.accelerate.Accelerator`` is the explicit form. Reversible patches of accelerate:

- ``fsdp2_prepare_model``: after accelerate's own ``fully_shard``, ``slipstream.fsdp.apply``;
  ``Accelerator.prepare_model``: an FSDP1 root gets the core's comm hook (``fsdp1.py``);
- ``AcceleratorState.__init__``: on CPU, stock accelerate runs DDP although FSDP is configured
  (its FSDP branch lists only accelerator devices; under ``accelerate launch`` with a GPU YAML,
  every process even runs alone: ``DistributedType.NO``); with slipstream on, the job runs FSDP
  on CPU as configured.

Settings come from the file ``SLIPSTREAM_CONFIG`` names (accelerate's YAML refuses unknown
keys), else ``SLIPSTREAM_*`` and the defaults.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os

from .._adapter import compile_model
from ..._common.patch import patch, uninstall_all
from ..._common.record import note_stack, warn_once

__all__ = ["install", "uninstall", "Accelerator"]

_OWNER = "accelerate"


def install() -> None:
    """Idempotent; ``uninstall`` undoes it exactly."""
    import accelerate.accelerator as acc
    import accelerate.state as state

    if hasattr(acc, "fsdp2_prepare_model"):
        _patch_fsdp2(acc)
    else:  # accelerate before its FSDP2 support (1.0 has none): FSDP1 and DDP are patched as usual
        from accelerate import __version__

        warn_once(f"accelerate {__version__} has no FSDP2 (fsdp2_prepare_model): slipstream takes its FSDP1 "
                  "and DDP jobs only")

    original_prepare_model = acc.Accelerator.prepare_model

    @functools.wraps(original_prepare_model)
    def prepare_model(self, model, *args, **kwargs):
        return _hook_fsdp1(original_prepare_model(self, model, *args, **kwargs))

    patch(acc.Accelerator, "prepare_model", prepare_model, owner=_OWNER)

    original_init = state.AcceleratorState.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        if _launched_for_fsdp_without_a_device(state):
            if len(args) >= 2:  # (mixed_precision, cpu, ...)
                args = (args[0], True, *args[2:])
            else:
                kwargs["cpu"] = True
        original_init(self, *args, **kwargs)
        _fsdp_on_cpu(self, kwargs.get("fsdp_plugin"))

    patch(state.AcceleratorState, "__init__", __init__, owner=_OWNER)


def _patch_fsdp2(acc) -> None:
    """``acc.fsdp2_prepare_model`` (``accelerate.accelerator``): after accelerate's own
    ``fully_shard``, ``slipstream.fsdp.apply`` (varlen before it, compile after it)."""
    original_prepare = acc.fsdp2_prepare_model

    @functools.wraps(original_prepare)
    def fsdp2_prepare_model(accelerator, model):
        from ..config import SlipstreamConfig
        from ..fsdp.fsdp2 import apply

        settings = SlipstreamConfig.from_env()  # SLIPSTREAM_CONFIG: the one config, read where it applies
        if settings is not None and not settings.enabled:
            note_stack("accelerate", engaged=False, why="SLIPSTREAM_CONFIG says enabled: false")
            return original_prepare(accelerator, model)
        varlen = settings.varlen if settings is not None else None
        if varlen is not None:
            from ...core_compile import apply_varlen

            apply_varlen(model, varlen)  # the bare model, before accelerate's fully_shard
        model = original_prepare(accelerator, model)
        switched = apply(model, config=settings.comm if settings is not None else None)
        compiled = compile_model(model, settings)  # after fully_shard: its hook-free regions
        note_stack("accelerate", engaged=True, fsdp_version=2, modules_through_the_core=len(switched),
                   varlen=varlen is not None, compile=compiled)
        return model

    patch(acc, "fsdp2_prepare_model", fsdp2_prepare_model, owner=_OWNER)


def uninstall() -> None:
    uninstall_all(_OWNER)


def _hook_fsdp1(model):
    """``model``; an FSDP1 root that accelerate just wrapped gets its reduce-scatter through the core."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel) and not getattr(model, "_slipstream_fsdp1", False):
        from ..fsdp.fsdp1 import register

        register(model)
        model._slipstream_fsdp1 = True
        note_stack("accelerate", engaged=True, fsdp_version=1, gradient_reduce_scatter="through the core")
    return model


def _destroy_groups() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):  # exiting anyway
            dist.destroy_process_group()


def _launched_for_fsdp_without_a_device(state_module) -> bool:
    """``accelerate launch`` with an FSDP YAML (``use_cpu: false``, as GPU configs have it) on a
    machine without an accelerator: accelerate would give every process
    ``DistributedType.NO``, each training alone on its own data. With slipstream on, the
    processes run as the multi-process CPU job they were launched as (then FSDP, below)."""
    import torch

    from accelerate.utils import parse_flag_from_env

    if (os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or parse_flag_from_env("ACCELERATE_USE_CPU")
            or "LOCAL_RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2):
        return False
    accelerator = getattr(torch, "accelerator", None)
    if torch.cuda.is_available() or (accelerator is not None and accelerator.is_available()):
        return False
    if state_module.PartialState._shared_state:  # the script made its PartialState already: too late
        warn_once("accelerate launch configured FSDP on a machine without an accelerator, and the script "
                  "created accelerate's PartialState before its Accelerator: every process runs alone "
                  "(accelerate's DistributedType.NO); create the Accelerator first, or pass cpu=True")
        return False
    return True


def _fsdp_on_cpu(state, fsdp_plugin) -> None:
    from accelerate.utils import DistributedType

    chosen = getattr(state, "_slipstream_fsdp_plugin", None)  # the state is shared: set once
    if chosen is not None:
        if state.distributed_type == DistributedType.MULTI_CPU:  # re-initialised: keep what we chose
            state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, chosen
        return
    asked = fsdp_plugin is not None or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if state.distributed_type != DistributedType.MULTI_CPU or not asked:
        return
    if fsdp_plugin is None:
        from accelerate.utils import FullyShardedDataParallelPlugin

        fsdp_plugin = FullyShardedDataParallelPlugin()
    if fsdp_plugin.fsdp_version != 2:  # accelerate's FSDP1 wrapping wants an accelerator device id
        if os.environ.get("LOCAL_RANK", "0") == "0":
            warn_once("FSDP1 was configured and the job runs on CPU, where accelerate cannot wrap FSDP1: it "
                      "runs accelerate's DDP (fsdp_version: 2 runs FSDP2 on CPU through slipstream)")
        return
    state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
    state._slipstream_fsdp_plugin = fsdp_plugin
    # FSDP2 on CPU with gloo, its process group left to the interpreter's end (as accelerate
    # scripts do), dies with SIGABRT at exit ("terminate called without an active exception")
    # in about 1 run of 8 with stock torch 2.13 alone: the job that runs FSDP on CPU because of
    # us destroys its groups at exit instead (0 of 9 then).
    atexit.register(_destroy_groups)
    if os.environ.get("LOCAL_RANK", "0") == "0":  # once per node, not once per rank
        warn_once("FSDP was configured and the job runs on CPU: accelerate would have used DDP; it runs FSDP "
                  f"(version {fsdp_plugin.fsdp_version}) as configured, with its collectives through slipstream")


def Accelerator(*args, **kwargs):  # noqa: N802 - a drop-in for the class
    """``accelerate.Accelerator(*args, **kwargs)`` with the adapter installed first."""
    install()
    import accelerate

    return accelerate.Accelerator(*args, **kwargs)
