"""``slipstream.enable()`` / ``slipstream.disable()``: the one-line switch.

``enable`` registers the ``slipstream`` backend (bound to ``config``, else each group reads
``SLIPSTREAM_*`` when it is created) and makes it torch's default backend for CPU: torch's
``default_device_backend_map["cpu"]`` becomes ``"slipstream"``. That table is what
``init_process_group()`` consults when no backend is named (since torch 2.6, also through
``device_id``) and what ``get_default_backend_for_device("cpu")`` answers, so a stack that
asks torch for the default gets slipstream, and one that names a backend keeps it.

CUDA keeps NCCL: ``default_device_backend_map["cuda"]`` is left alone, because NCCL over
NVLink / InfiniBand beats any path through host memory, and the communicator itself sends
CUDA tensors of a group with NCCL to NCCL.

``disable`` puts torch's backend tables, and the functions ``enable`` wrapped, back exactly as
they were before the first ``enable``. Groups already created keep working.
"""

from __future__ import annotations

import torch.distributed as dist

from .core_comm import _backend_registry as registry
from .core_comm.config import CommConfig
from .plugins import autoload

__all__ = ["disable", "enable", "is_enabled"]

_DEVICE = "cpu"


class _Switch:
    """What ``enable`` changed: the state of torch's tables before it (None: not enabled)."""

    __slots__ = ("before",)

    def __init__(self) -> None:
        self.before: dict | None = None


_SWITCH = _Switch()


def enable(config: CommConfig | None = None) -> None:
    """Make ``slipstream`` the backend of a later ``init_process_group()`` without a backend
    (CPU). Idempotent; calling it again with another ``config`` rebinds the config for groups
    created from then on. ``config=None``: ``CommConfig.from_env()`` at each group's creation.
    """
    if config is not None and not isinstance(config, CommConfig):
        raise TypeError(f"config must be a CommConfig, got {type(config).__name__}")
    if _SWITCH.before is None:
        _SWITCH.before = registry.snapshot()
    registry.register(config)
    registry.install_barrier_shim()
    dist.Backend.default_device_backend_map[_DEVICE] = registry.BACKEND
    # Stacks that name their backend themselves (DeepSpeed) are switched by their adapter,
    # installed when the stack is imported (now, if it already is).
    autoload.install_hooks()


def disable() -> None:
    """Undo ``enable`` exactly; a no-op when not enabled."""
    if _SWITCH.before is None:
        return
    registry.restore(_SWITCH.before)
    autoload.remove_hooks()
    _SWITCH.before = None


def is_enabled() -> bool:
    return _SWITCH.before is not None
