"""One communicator per process group, for every entry point: the backend, the DDP hook, the
adapters' stand-ins.

    comm = pool.for_call(group, tensor, op, kind="all_reduce")   # None: the group's own collective
    comm = pool.get(group)               # collective on first use: every member calls it
    pool.close(group)                    # that group's communicator only

``for_call`` is how an entry point asks the routing decision (``routing.decide``) before it
touches a communicator: a call the decision leaves to the group's own collective (a CUDA
tensor on NCCL) builds nothing, and the pool keeps, per group and device, why it stayed
(``stayed``, read by ``slipstream.status()``).

A communicator is built on the first ``get`` of its group (a collective: node subgroups,
shared memory, the tuner's plan) and kept until ``close(group)`` or until torch forgets the
group (``destroy_process_group``). Every communicator runs the tuner's measured plan when
``slipstream tune`` cached one for the topology, else the built-in rule (``routing.route``),
so a call of a given size takes the same path from the backend, the DDP hook, FSDP or
DeepSpeed. A ``get`` asking for other settings keeps the built communicator and says so once
(rebuilding would be a collective the other ranks are not in). A group whose collectives come
back to the core (the ``slipstream`` backend's) gives what to build over (``core_spec``), so
the core's own collectives never come back to it.
"""

from __future__ import annotations

import atexit
import logging
import threading

import torch
import torch.distributed as dist

from .._common import record
from . import counters, routing
from .communicator import Communicator
from .config import CommConfig
from .groups import release_groups

__all__ = ["CommunicatorPool", "close", "close_all", "decide", "for_call", "get", "items", "peek", "stayed"]

log = logging.getLogger("slipstream.comm")


class CommunicatorPool:
    """Communicators by process group (None: WORLD)."""

    __slots__ = ("_comms", "_asked", "_warned", "_lock", "_exit_hook", "_decided", "_stayed", "default")

    def __init__(self) -> None:
        self._comms: dict = {}  # group -> Communicator
        self._asked: dict = {}  # group -> the config it was built for (a tuner plan may adjust it)
        self._decided: dict = {}  # (group, device type) -> (backend, the settings decided with)
        self._stayed: dict = {}  # group -> {device type: why its calls stay the group's own}
        self._warned: set = set()  # (group, config) pairs already warned about
        self._lock = threading.RLock()
        self._exit_hook = False
        self.default: CommConfig | None = None
        """The settings of a group no code gave settings to (``slipstream.enable(config)``
        passes its ``config`` down here); None: ``CommConfig.from_env()`` at each build."""

    def default_config(self) -> CommConfig:
        """``default``, else the environment's settings (``CommConfig.from_env``)."""
        return self.default if self.default is not None else CommConfig.from_env()

    def get(self, group: dist.ProcessGroup | None = None, *, config: CommConfig | None = None) -> Communicator:
        """The communicator of ``group``; built (collectively) on first use with ``config``
        (None: ``default_config()``), running the tuner's cached plan if there is one."""
        key = _key(group)
        with self._lock:
            comm = self._comms.get(key)
            if comm is not None and not _alive(key):
                _close(key, self._comms.pop(key))
                comm = None
            if comm is not None:
                if config is not None and config != self._asked[key] and (key, config) not in self._warned:
                    self._warned.add((key, config))
                    log.warning("slipstream: the communicator of group %s was built with %s; keeping it, "
                                "not %s (destroy the group or close it to change settings)", _ranks(key),
                                comm.config, config)
                return comm
            resolved = config if config is not None else self.default_config()
            comm = self._comms[key] = _build(key, resolved)
            self._asked[key] = resolved  # a later call asking the same settings is not warned
            if not self._exit_hook:
                # at exit, before torch's process groups are torn down: our worker threads
                # finish and our memory is released (a process that left them to the
                # interpreter's end died with SIGABRT, 2 runs in 6, after an FSDP job)
                atexit.register(self.close_all)
                self._exit_hook = True
        record.start()  # a job uses slipstream now: the start line (unless an adapter defers it)
        return comm

    def decide(self, group, device_type: str, dtype, op=dist.ReduceOp.SUM, *,
               config: CommConfig | None = None) -> str | None:
        """``routing.decide`` for a call on ``group`` (None: WORLD): None when the core takes it,
        else why it stays the group's own collective. The group's backend for the device and
        its settings (``config``; None: the built communicator's, else ``default_config()``)
        are read once per (group, device type); a reason that holds for every call of the
        device (its backend's) is kept for ``stayed``. Local: builds nothing."""
        key = _key(group)
        with self._lock:
            known = self._decided.get((key, device_type))
            if known is None:
                comm = self._comms.get(key)
                settings = (comm.config if comm is not None else config if config is not None
                            else self.default_config())
                known = self._decided[key, device_type] = (routing.backend_of(key, device_type), settings)
            backend, settings = known
            why = routing.decide(device_type, backend, op, dtype, config=settings)
            if why is not None and routing.decide(device_type, backend, dist.ReduceOp.SUM, _PLAIN,
                                                  config=settings) is not None:
                self._stayed.setdefault(key, {})[device_type] = why
        return why

    def for_call(self, group, tensor, op=dist.ReduceOp.SUM, *, kind: str, nbytes: int | None = None,
                 config: CommConfig | None = None) -> Communicator | None:
        """The communicator of ``group`` for ``kind`` of ``tensor`` with ``op`` (an all-gather:
        its input) when the routing decision (``decide``) gives the call to the core, built on
        the first such call (a collective: every rank decides alike); None when the call stays
        the group's own collective, counted under ``stock`` with ``nbytes`` (None: the
        tensor's). The caller then makes the stock call and hands back its ``Work`` as it is."""
        if self.decide(group, tensor.device.type, tensor.dtype, op, config=config) is None:
            return self.get(group, config=config)
        counters.count(kind, "stock", tensor.numel() * tensor.element_size() if nbytes is None else nbytes)
        return None

    def stayed(self) -> list:
        """``(group, {device type: why})`` of the live groups whose calls of some device stay
        the group's own (a CUDA tensor on NCCL), whether or not a communicator was built."""
        with self._lock:
            return [(g, dict(why)) for g, why in self._stayed.items() if _alive(g)]

    def peek(self, group: dist.ProcessGroup | None = None) -> Communicator | None:
        """The built communicator of ``group``, or None; never builds."""
        with self._lock:
            return self._comms.get(_key(group))

    def items(self) -> list:
        """``(group, communicator)`` of every built communicator of a live group."""
        with self._lock:
            return [(g, c) for g, c in self._comms.items() if _alive(g)]

    def held_bytes(self) -> int:
        """What this rank's communicators keep from call to call (``Communicator.held_bytes``)."""
        return sum(c.held_bytes() for _, c in self.items())

    def close(self, group: dist.ProcessGroup | None = None) -> None:
        """Close ``group``'s communicator (finishing its pending calls); others stay."""
        key = _key(group)
        with self._lock:
            comm = self._comms.pop(key, None)
            self._asked.pop(key, None)
            self._forget(key)
        if comm is not None:
            _close(_key(group), comm)

    def close_all(self) -> None:
        with self._lock:
            comms, self._comms, self._asked = list(self._comms.items()), {}, {}
            self._decided, self._stayed = {}, {}
        for key, comm in comms:
            _close(key, comm)


    def _forget(self, key) -> None:
        """Drop what was decided for ``key`` (the lock held)."""
        self._stayed.pop(key, None)
        for entry in [k for k in self._decided if k[0] is key]:
            del self._decided[entry]


_PLAIN = torch.float32  # a dtype and op every path reduces: what fails with them is the group's, not the call's


def _close(key, comm: Communicator) -> None:
    """Close ``comm``, and the gloo group it ran over where ``key``'s ``core_spec`` made that
    one for it (a group made and destroyed many times must not keep its sockets and threads)."""
    comm.close()
    if comm.group is not None and comm.group is not key:
        release_groups(comm.group)


def _key(group):
    return dist.group.WORLD if group is None else group


def _alive(group) -> bool:
    """Whether torch still knows ``group`` (a destroyed group's entry is stale)."""
    return dist.is_initialized() and group in dist.distributed_c10d._world.pg_map


def _ranks(group) -> list[int]:
    try:
        return dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        return []


def _build(group, config: CommConfig) -> Communicator:
    from .tuner import tuned_communicator

    over, checker = group, None
    core_spec = getattr(group, "core_spec", None)
    if core_spec is not None:
        # a group of the slipstream backend: the communicator runs over the gloo group it gives,
        # within its timeout, with its same-call check
        over, config, checker = core_spec(config)
    return tuned_communicator(over, config=config, checker=checker, model=False)


# The process's pool: a communicator belongs to its group, and a group to the process.
POOL = CommunicatorPool()
get = POOL.get
for_call = POOL.for_call
decide = POOL.decide
stayed = POOL.stayed
peek = POOL.peek
held_bytes = POOL.held_bytes
default_config = POOL.default_config
items = POOL.items
close = POOL.close
close_all = POOL.close_all
