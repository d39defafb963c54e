"""Settings of the collectives core. Read from the environment only in ``from_env``."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Mapping

__all__ = ["CommConfig", "check_field"]

_ENV_PREFIX = "SLIPSTREAM_"


@dataclass(kw_only=True, frozen=True)
class CommConfig:
    """How the communicator chooses and runs its algorithms."""

    shm: bool = True
    """Use shared memory among the ranks of one node."""
    cma: bool = True
    """On one node, large messages move between the ranks' own tensors by cross-memory
    attach (``process_vm_readv``/``writev``) instead of through shared memory, where the
    kernel allows it (probed once at set-up)."""
    hierarchical: bool = True
    """Across nodes: shared memory inside, the stock backend across, pipelined."""
    slot_bytes: int = 1 << 20
    """Bytes per rank per pipeline slot of the shared-memory path."""
    small_bytes: int = 64 << 10
    """Up to this size an allreduce takes the one-synchronisation (latency) path."""
    chunk_bytes: int = 4 << 20
    """Chunk of the hierarchical pipeline (and of CUDA staging); an allreduce of more than four
    chunks, with no tuner plan for its size, takes a quarter of the message per chunk."""
    connections: int = 1
    """TCP connections per inter-node peer (1-16). 1 uses the group's own backend (gloo);
    more split each inter-node message across that many connections (``transport.py``)."""
    port_base: int = 0
    """First listening port of the multi-connection transport (each rank takes a free block
    of ``connections`` ports from here); 0 lets the kernel pick."""
    min_hierarchical_bytes: int = 0
    """Smaller messages across nodes use the stock collective (when no plan decides: a
    tuner's plan, measured or modelled, overrides this for the sizes it covers)."""
    cuda_staging: bool = True
    """Stage CUDA tensors through pinned host memory where the group has no NCCL."""
    timeout_s: float = 300.0
    """A shared-memory wait, an inter-node transfer of the multi-connection transport or its
    set-up that makes no progress for this long raises (a peer died or called something else)."""
    debug: bool = False
    """Before every collective, check that all ranks call it with the same size and dtype."""

    def __post_init__(self) -> None:
        for f in fields(self):
            check_field(f.name, getattr(self, f.name))
        if self.small_bytes > self.slot_bytes:
            raise ValueError(
                f"small_bytes must be between 0 and slot_bytes ({self.slot_bytes}), got {self.small_bytes}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **overrides) -> "CommConfig":
        """``SLIPSTREAM_<FIELD>`` (upper case) for every field, e.g. ``SLIPSTREAM_SHM=0``;
        ``overrides`` (a stack's config section) win over the environment. A bad variable is
        refused naming it, before any group is built."""
        values: dict = {}
        for f in fields(cls):
            name = _ENV_PREFIX + f.name.upper()
            raw = environ.get(name)
            if raw is None or f.name in overrides:
                continue
            kind = type(f.default)
            try:
                values[f.name] = _parse_bool(raw) if kind is bool else kind(raw)
                check_field(f.name, values[f.name])
            except ValueError as e:
                raise ValueError(f"{name}={raw!r}: {e}") from None
        values.update(overrides)
        return cls(**values)


def check_field(name: str, value) -> None:
    """Refuse a bad value of field ``name`` with a ``ValueError`` that says why."""
    if name in ("slot_bytes", "chunk_bytes") and (value <= 0 or value % 64):
        raise ValueError(f"{name} must be a positive multiple of 64, got {value}")
    if name == "small_bytes" and value < 0:
        raise ValueError(f"small_bytes must be >= 0, got {value}")
    if name == "connections" and not 1 <= value <= 16:
        raise ValueError(f"connections must be between 1 and 16, got {value}")
    if name == "port_base" and not 0 <= value < 65536:
        raise ValueError(f"port_base must be a port number (or 0), got {value}")
    if name == "min_hierarchical_bytes" and value < 0:
        raise ValueError(f"min_hierarchical_bytes must be >= 0, got {value}")
    # nan and inf would switch every bounded wait off
    if name == "timeout_s" and not (math.isfinite(value) and value > 0):
        raise ValueError(f"timeout_s must be a positive finite number of seconds, got {value}")


def _parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")
