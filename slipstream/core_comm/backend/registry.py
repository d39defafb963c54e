"""Registration of the ``slipstream`` backend with torch.distributed, and its exact undo.

``register`` is idempotent and touches only torch's backend tables; the ``monitored_barrier``
shim is installed by ``slipstream.enable`` and by the creation of a slipstream group, not by
``import slipstream``. ``snapshot`` / ``restore`` put the tables and the shimmed functions back
exactly as they were, which is what ``slipstream.disable`` does. The group class and the communicator are imported only when torch creates a group, so
registering costs no more than importing torch.distributed.
"""

from __future__ import annotations

import functools
import sys
import warnings
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..config import CommConfig

__all__ = ["BACKEND", "install_barrier_shim", "register", "restore", "snapshot"]

BACKEND = "slipstream"
DEVICES = ("cpu", "cuda")
_MARKER = "__slipstream_patch__"
_MISSING = object()


def _creator(config: CommConfig | None):
    def create_slipstream_group(dist_options, pg_options=None):
        from .process_group import create_process_group

        install_barrier_shim()  # torch refuses monitored_barrier on a backend not named gloo
        return create_process_group(dist_options, pg_options, config=config)

    create_slipstream_group.config = config  # type: ignore[attr-defined]
    return create_slipstream_group


def registered_config(default: Any = None) -> CommConfig | None:
    """The config bound at registration (None: the environment, per group)."""
    plugin = dist.Backend._plugins.get(BACKEND.upper())
    return getattr(plugin.creator_fn, "config", default) if plugin else default


def register(config: CommConfig | None = None) -> None:
    """Register ``slipstream`` (again: with ``config`` bound). Changes no default: the cpu and
    cuda entries of torch's ``default_device_backend_map`` stay as they are."""
    if config is not None and not isinstance(config, CommConfig):
        raise TypeError(f"config must be a CommConfig, got {type(config).__name__}")
    plugin = dist.Backend._plugins.get(BACKEND.upper())
    if plugin is None or getattr(plugin.creator_fn, "config", _MISSING) is not config:
        dist.Backend.register_backend(BACKEND, _creator(config), extended_api=True, devices=list(DEVICES))


def install_barrier_shim() -> None:
    """Let ``monitored_barrier`` run on slipstream groups (idempotent)."""
    for module in (dist, c10d):
        if not getattr(module.monitored_barrier, _MARKER, False):
            module.monitored_barrier = _monitored_barrier(module.monitored_barrier)


# -------------------------------------------------------------------- exact undo

_TABLES = ("backend_list", "backend_type_map", "backend_capability", "_plugins", "default_device_backend_map")


def snapshot() -> dict:
    """What ``register`` and ``slipstream.enable`` change, to hand to ``restore``."""
    B = dist.Backend
    return {
        "attr": B.__dict__.get(BACKEND.upper(), _MISSING),
        "tables": {name: _copy(getattr(B, name)) for name in _TABLES},
        "functions": {module: module.monitored_barrier for module in (dist, c10d)},
    }


def restore(saved: dict) -> None:
    """Put torch's backend tables and ``monitored_barrier`` back as ``saved`` holds them.
    The table objects are updated in place: other modules hold references to them."""
    B = dist.Backend
    if saved["attr"] is _MISSING:
        if BACKEND.upper() in B.__dict__:
            delattr(B, BACKEND.upper())
    else:
        setattr(B, BACKEND.upper(), saved["attr"])
    for name, value in saved["tables"].items():
        table = getattr(B, name)
        if isinstance(table, list):
            table[:] = value
        else:
            table.clear()
            table.update(value)
    for module, fn in saved["functions"].items():
        module.monitored_barrier = fn


def _copy(table):
    return list(table) if isinstance(table, list) else dict(table)


# -------------------------------------------------------------------- monitored_barrier

def _monitored_barrier(original):
    """torch's ``monitored_barrier`` refuses any backend not named ``gloo`` before it looks at
    the group. A slipstream group's barrier is gloo's own (its default backend), so for those
    groups the check is skipped; every other group goes to the original unchanged."""

    @functools.wraps(original)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        target = group if group is not None else (c10d._get_default_group() if dist.is_initialized() else None)
        module = sys.modules.get(__package__ + ".process_group")
        if module is None or not isinstance(target, module.SlipstreamProcessGroup):
            return original(group, timeout, wait_all_ranks)
        if timeout is None:
            timeout = c10d._get_default_timeout(dist.Backend.GLOO)
        elif isinstance(timeout, float):
            warnings.warn("Please specify timeout arg as a timedelta. Converting current value of "
                          f"{timeout} assuming it represents seconds", stacklevel=2)
            timeout = timedelta(seconds=timeout)
        c10d._check_valid_timeout(timeout)
        return target.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    setattr(monitored_barrier, _MARKER, True)
    return monitored_barrier
