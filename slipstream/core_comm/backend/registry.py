"""Registration of the ``slipstream`` backend with torch.distributed, and its exact undo.

``register`` is idempotent and touches only torch's backend tables. The ``monitored_barrier``
shim (a patch in ``_common.patch``'s registry) is installed by ``slipstream.enable`` and by the
creation of a slipstream group, not by ``import slipstream``. ``record_tables`` records the
tables so that the registry's undo (``slipstream.disable``) puts them back exactly.
"""

from __future__ import annotations

import functools
import warnings
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..._common.patch import change, patch
from . import BACKEND

__all__ = ["BACKEND", "install_barrier_shim", "record_tables", "register"]

DEVICES = ("cpu", "cuda")
_MISSING = object()


def _create_slipstream_group(dist_options, pg_options=None):
    from .process_group import create_process_group  # the communicator's modules load with the first group

    install_barrier_shim()  # torch refuses monitored_barrier on a backend not named gloo
    return create_process_group(dist_options, pg_options)


def register() -> None:
    """Register ``slipstream`` (idempotent). Changes no default: the cpu and cuda entries of
    torch's ``default_device_backend_map`` stay as they are."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create_slipstream_group, extended_api=True, devices=list(DEVICES))


def install_barrier_shim() -> None:
    """Let ``monitored_barrier`` run on slipstream groups (idempotent)."""
    for module in (dist, c10d):
        patch(module, "monitored_barrier", _monitored_barrier(module.monitored_barrier), owner="backend")


_TABLES = ("backend_list", "backend_type_map", "backend_capability", "_plugins", "default_device_backend_map")


def record_tables(owner: str) -> None:
    """Record torch's backend tables as they are now, once: undoing the record (the patch
    registry's ``uninstall_all``) puts them back exactly, in place."""
    what = "torch.distributed.Backend tables"
    change(what, what, functools.partial(_restore, _snapshot()), owner=owner)


def _snapshot() -> dict:
    B = dist.Backend
    return {"attr": B.__dict__.get(BACKEND.upper(), _MISSING),
            "tables": {name: _copy(getattr(B, name)) for name in _TABLES}}


def _restore(saved: dict) -> None:
    """Put torch's backend tables back as ``saved`` holds them. The table objects are updated
    in place: other modules hold references to them."""
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


def _copy(table):
    return list(table) if isinstance(table, list) else dict(table)


def _monitored_barrier(original):
    """torch's ``monitored_barrier`` refuses any backend not named ``gloo`` before it looks at
    the group. A slipstream group's barrier is gloo's own (its default backend), so for those
    groups the check is skipped; every other group goes to the original unchanged."""

    @functools.wraps(original)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        from .process_group import SlipstreamProcessGroup  # loaded: the shim comes with the first group

        target = group if group is not None else (c10d._get_default_group() if dist.is_initialized() else None)
        if not isinstance(target, SlipstreamProcessGroup):
            return original(group, timeout, wait_all_ranks)
        if timeout is None:
            timeout = c10d._get_default_timeout(dist.Backend.GLOO)
        elif isinstance(timeout, float):
            warnings.warn("Please specify timeout arg as a timedelta. Converting current value of "
                          f"{timeout} assuming it represents seconds", stacklevel=2)
            timeout = timedelta(seconds=timeout)
        c10d._check_valid_timeout(timeout)
        return target.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    return monitored_barrier
