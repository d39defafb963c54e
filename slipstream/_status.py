"""What slipstream does in this process, for the user to see: ``slipstream.status()`` (a dict)
and one line on rank 0 when a job starts using it.

The line names who turned slipstream on, what each stack adapter did (DeepSpeed: ZeRO stage,
collectives routed, varlen on the model), each group's fast paths (``shm``, ``cma``,
``hierarchical`` over the multi-connection ``transport`` or gloo) and what stays stock and
why. It goes to the ``slipstream`` logger at INFO when the user's logging shows INFO, else to
stderr (``SLIPSTREAM_QUIET=1`` silences it). Warnings for a switch that does nothing (a stack
running stock while slipstream is on) go through ``warnings_once``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Any

__all__ = ["announce", "deferred", "line", "note_stack", "status", "warn_once"]

log = logging.getLogger("slipstream")


class _State:
    __slots__ = ("stacks", "warnings", "announced", "deferred", "lock")

    def __init__(self) -> None:
        self.stacks: dict[str, dict] = {}
        self.warnings: list[str] = []
        self.announced: set = set()
        self.deferred = 0  # > 0 while an adapter sets a job up: it announces when done
        self.lock = threading.Lock()


_STATE = _State()


def note_stack(name: str, **facts: Any) -> None:
    """An adapter records what it did (or why it left its stack stock)."""
    with _STATE.lock:
        _STATE.stacks[name] = dict(facts)


def warn_once(message: str) -> None:
    """A warning, once per process, kept for ``status()``."""
    with _STATE.lock:
        if message in _STATE.warnings:
            return
        _STATE.warnings.append(message)
    log.warning("slipstream: %s", message)


def status() -> dict:
    """This process's view: switches, stacks, groups and their paths, per-collective counts."""
    import torch.distributed as dist

    from . import __version__
    from .core_comm import counters, pool
    from ._common import patch as _patch
    from .switch import _SWITCH

    groups = [_describe(group, comm) for group, comm in pool.items()]
    with _STATE.lock:
        stacks = {k: dict(v) for k, v in _STATE.stacks.items()}
        warnings = list(_STATE.warnings)
    world = dist.get_backend_config() if dist.is_initialized() else None
    named = "slipstream named as the backend" if world and "slipstream" in world else None
    return {
        "version": __version__,
        "enabled": _SWITCH.before is not None,
        "enabled_by": _SWITCH.source or ", ".join(v.get("by", f"{k} config") for k, v in stacks.items()
                                                  if v.get("engaged")) or named,
        "autoload": _autoload(),
        "default_cpu_backend": dist.Backend.default_device_backend_map.get("cpu"),
        "world_backend": world,
        "stacks": stacks,
        "groups": groups,
        "collectives": counters.snapshot(),
        "patches": _patch.patches(),
        "warnings": warnings,
    }


def line(st: dict | None = None) -> str:
    """``status()`` in one line."""
    st = st if st is not None else status()
    parts = [f"slipstream {st['version']}: " + (f"on ({st['enabled_by']})" if st["enabled_by"] else "off")]
    if st["world_backend"]:
        parts.append(f"world backend {st['world_backend']}")
    for name, facts in st["stacks"].items():
        parts.append(f"{name}: " + ", ".join(f"{k} {v}" if not isinstance(v, bool) else k
                                             for k, v in facts.items() if v not in (False, None, "") and k != "by"))
    for g in st["groups"]:
        what = "+".join(g["paths"]) if g["paths"] else f"stock ({g['stock_because']})"
        parts.append(f"group of {len(g['ranks'])} ranks on {g['nodes']} node(s): {what}")
    routed = {k: sorted(v) for k, v in st["collectives"].items()}
    if routed:
        parts.append("calls so far " + " ".join(f"{k}:{'/'.join(v)}" for k, v in routed.items()))
    if st["groups"] or st["stacks"]:
        parts.append("everything else stock (broadcast, send/recv, all_to_all, object collectives)")
    return "; ".join(parts)


@contextlib.contextmanager
def deferred():
    """While an adapter sets a job up, the communicators it builds do not announce."""
    with _STATE.lock:
        _STATE.deferred += 1
    try:
        yield
    finally:
        with _STATE.lock:
            _STATE.deferred -= 1


def announce(event: str = "start", *, by_adapter: bool = False) -> None:
    """Log ``line()`` on global rank 0, once per ``event``: the job's start by default."""
    import torch.distributed as dist

    if os.environ.get("SLIPSTREAM_QUIET", "") not in ("", "0"):
        return
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    with _STATE.lock:
        if event in _STATE.announced or (_STATE.deferred and not by_adapter):
            return
        _STATE.announced.add(event)
    text = line()
    if log.isEnabledFor(logging.INFO) and (log.handlers or logging.getLogger().handlers):
        log.info(text)
    else:
        print(f"[slipstream] {text}", file=sys.stderr, flush=True)


def _describe(group, comm) -> dict:
    import torch

    from .core_comm.groups import group_ranks

    paths = []
    if comm.shm is not None:
        paths.append("shm")
    if comm.cma is not None:
        paths.append("cma")
    if comm.hier is not None:
        inter = comm.hier.inter
        n = getattr(inter, "connections", None)
        paths.append(f"hierarchical over {'transport x' + str(n) if n else 'gloo'}")
    if comm.config.cuda_staging and torch.cuda.is_available():
        paths.append("cuda staging")
    topo = comm.topology
    return {"ranks": group_ranks(comm.group), "nodes": topo.num_nodes, "ranks_per_node": topo.local_size,
            "paths": paths, "stock_because": comm.unavailable or None,
            "plan": getattr(comm.plan, "source", None)}


def _autoload() -> str:
    finders = [f for f in sys.meta_path if type(f).__name__ == "SlipstreamAutoload"]
    if os.environ.get("SLIPSTREAM_AUTOLOAD", "1").strip().lower() in ("0", "false", "no", "off"):
        return "off (SLIPSTREAM_AUTOLOAD=0)"
    if "slipstream_autoload" not in sys.modules:
        return "not installed in this environment"
    return "waiting for " + ", ".join(sorted(finders[0].pending)) if finders else "acted"
