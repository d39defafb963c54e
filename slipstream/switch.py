"""``slipstream.enable()`` / ``slipstream.disable()``: the one-line switch.

``enable`` registers the ``slipstream`` backend (every group then takes ``config``, else reads
its settings when it is created: ``CommConfig.from_env()``) and makes it torch's default for
CPU (``default_device_backend_map["cpu"]``): what ``init_process_group()`` consults when no
backend is named (since torch 2.6, also through ``device_id``) and what
``get_default_backend_for_device("cpu")`` answers, so a stack that asks torch for the default
gets slipstream, and one that names a backend keeps it. CUDA keeps NCCL: NCCL over NVLink /
InfiniBand beats any path through host memory, and the communicator itself sends a group's
CUDA tensors to NCCL.

``disable`` uninstalls every stack adapter and undoes every entry of the patch registry
(``_common.patch``) exactly. Groups already created keep working.
"""

from __future__ import annotations

import functools
import sys

import torch.distributed as dist

from ._common import record
from ._common.patch import patch, uninstall_all
from .core_comm.backend import registry
from .core_comm.config import CommConfig
from .plugins import autoload

__all__ = ["disable", "enable", "is_enabled"]

def enable(config: CommConfig | None = None, *, source: str = "enable()") -> None:
    """Make ``slipstream`` the backend of a later ``init_process_group()`` without a backend
    (CPU). Idempotent; calling it again with another ``config`` rebinds the config for groups
    created from then on. ``config=None``: ``CommConfig.from_env()`` at each group's creation.
    ``source`` says who turned it on (``status()["enabled_by"]``)."""
    if config is not None and not isinstance(config, CommConfig):
        raise TypeError(f"config must be a CommConfig, got {type(config).__name__}")
    registry.record_tables(owner="switch")  # the first enable's tables are what disable restores
    if not record.switch.on:
        record.switch.source = source
    record.switch.config = config
    _default_to(config)
    registry.register()
    registry.install_barrier_shim()
    dist.Backend.default_device_backend_map["cpu"] = registry.BACKEND
    _watch_init()
    # Stacks that name their backend themselves (DeepSpeed) are switched by their adapter,
    # installed when the stack is imported (now, if it already is).
    autoload.install_hooks()


def disable() -> None:
    """Undo ``enable`` and everything slipstream changed since, exactly; a no-op when off."""
    autoload.remove_hooks()
    uninstall_all()
    record.switch.source, record.switch.config = "", None
    _default_to(None)


def _default_to(config: CommConfig | None) -> None:
    """Hand ``config`` to the core as the settings of groups no code gives settings to (the
    pool's default). The pool loads the communicator: with no config and no pool loaded yet,
    there is nothing to hand (its default is None), and ``import slipstream`` stays light."""
    if config is not None or "slipstream.core_comm.pool" in sys.modules:
        from .core_comm import pool

        pool.POOL.default = config


def is_enabled() -> bool:
    return record.switch.on


def _watch_init() -> None:
    """Wrap ``init_process_group`` to say when a named backend keeps the default group stock."""
    original = dist.init_process_group

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        result = original(*args, **kwargs)
        backend = dist.get_backend_config()  # "cpu:gloo"; get_backend() says "undefined" for ours
        adapters = ("deepspeed", "accelerate")  # they route the groups they use themselves
        if registry.BACKEND not in backend and not any(m in sys.modules for m in adapters):
            record.warn_once(f"slipstream is on, but init_process_group was given backend {backend!r}: the "
                             "default group's collectives stay stock. Leave the backend out (or name "
                             f"{registry.BACKEND!r}) to route them through slipstream.")
        return result

    patch(dist, "init_process_group", init_process_group, owner="switch")
