"""What slipstream does in this process, for the user to see: ``slipstream.status()`` (a dict),
and one line on rank 0 when a job starts using it: who turned slipstream on, what each stack
adapter did, each group's fast paths and what stays stock and why. The line goes to the
``slipstream`` logger at INFO when the user's logging shows INFO, else to stderr
(``SLIPSTREAM_QUIET=1`` silences it). The facts come from ``_common.record``, the communicator
pool and the patch registry.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed as dist

from ._common import patch, record
from ._common.settings import parse_bool
from ._common.version import __version__
from .core_comm import counters, pool
from .core_comm.groups import group_ranks

__all__ = ["announce", "line", "status"]

log = logging.getLogger("slipstream")


def status() -> dict:
    """This process's view: switches, stacks, groups and their paths, per-collective counts,
    and every change slipstream made to other code (``patches``, with the part that made it)."""
    groups = [_describe(group, comm) for group, comm in pool.items()]
    stayed = [{"ranks": group_ranks(group), "stays_stock": why} for group, why in pool.stayed()]
    stacks = record.stacks()
    world = dist.get_backend_config() if dist.is_initialized() else None
    named = "slipstream named as the backend" if world and "slipstream" in world else None
    return {
        "version": __version__,
        "enabled": record.switch.on,
        "enabled_by": record.switch.source or ", ".join(v.get("by", f"{k} config") for k, v in stacks.items()
                                                       if v.get("engaged")) or named,
        "autoload": _autoload(),
        "default_cpu_backend": dist.Backend.default_device_backend_map.get("cpu"),
        "comm_settings": _comm_settings(),
        "world_backend": world,
        "stacks": stacks,
        "groups": groups,
        "groups_left_stock": stayed,
        "collectives": counters.snapshot(),
        "patches": patch.patches(),
        "warnings": record.warnings(),
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
    for g in st.get("groups_left_stock", ()):
        parts.append(f"group of {len(g['ranks'])} ranks: " + ", ".join(
            f"{device} calls stay stock ({why})" for device, why in sorted(g["stays_stock"].items())))
    routed = {k: sorted(v) for k, v in st["collectives"].items()}
    if routed:
        parts.append("calls so far " + " ".join(f"{k}:{'/'.join(v)}" for k, v in routed.items()))
    if st["groups"] or st["stacks"] or st.get("groups_left_stock"):
        parts.append("everything else stock (broadcast, send/recv, all_to_all, object collectives)")
    return "; ".join(parts)


def announce() -> None:
    """Log ``line()`` on global rank 0 (``record.start`` calls it once, when a job starts)."""
    if _flag("SLIPSTREAM_QUIET", False) or (dist.is_initialized() and dist.get_rank() != 0):
        return
    text = line()
    if log.isEnabledFor(logging.INFO) and (log.handlers or logging.getLogger().handlers):
        log.info(text)
    else:
        print(f"[slipstream] {text}", file=sys.stderr, flush=True)


def _describe(group, comm) -> dict:
    paths = [name for name, path in (("shm", comm.shm), ("cma", comm.cma)) if path is not None]
    if comm.hier is not None:
        n = getattr(comm.hier.inter, "connections", None)
        paths.append(f"hierarchical over {'transport x' + str(n) if n else 'gloo'}")
        if comm.wire is not None:
            paths.append(f"{comm.config.wire} across nodes from {comm.config.wire_min_bytes} bytes "
                         "(float reductions and all-gathers; lossy)")
    if torch.cuda.is_available() and pool.decide(group, "cuda", torch.float32) is None:
        paths.append("cuda staging")  # CUDA tensors through pinned host memory (no NCCL on the group)
    topo = comm.topology
    return {"ranks": group_ranks(comm.group), "nodes": topo.num_nodes, "ranks_per_node": topo.local_size,
            "paths": paths, "stock_because": comm.unavailable or None,
            "plan": getattr(comm.plan, "source", None), "config": comm.config.to_dict()}


def _comm_settings() -> dict | str:
    """The settings a slipstream group created now gets: ``enable(config)``'s, else the
    environment's (``CommConfig.from_env``: the ``SLIPSTREAM_CONFIG`` file, ``SLIPSTREAM_*``)."""
    try:
        return pool.default_config().to_dict()
    except ValueError as e:  # a bad setting: groups will refuse it by name
        return f"invalid: {e}"


def _autoload() -> str:
    if not _flag("SLIPSTREAM_AUTOLOAD", True):
        return "off (SLIPSTREAM_AUTOLOAD=0)"
    if "slipstream_autoload" not in sys.modules:
        return "not installed in this environment"
    finders = [f for f in sys.meta_path if type(f).__name__ == "SlipstreamAutoload"]
    return "waiting for " + ", ".join(sorted(finders[0].pending)) if finders else "acted"


def _flag(name: str, default: bool) -> bool:
    """A boolean variable as the start-up hook reads it (``slipstream_autoload._flag``): unset,
    empty or unreadable is ``default``."""
    raw = os.environ.get(name, "")
    try:
        return parse_bool(raw) if raw.strip() else default
    except ValueError:
        return default
