"""Settings of the collectives core, read through the one settings reader
(``_common.settings``). The environment is read only in ``from_env`` (and ``resolve``)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from .._common.settings import Settings, config_file, require_mapping

__all__ = ["WIRE_FORMATS", "CommConfig"]

WIRE_FORMATS = ("full", "bf16", "int8")


@dataclass(kw_only=True, frozen=True)
class CommConfig(Settings):
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
    chunks, with no tuner plan for its size, takes a quarter of the message per chunk, a
    reduce-scatter or allgather a quarter of its larger buffer up to 16 MiB."""
    connections: int = 1
    """TCP connections per inter-node peer (1-16). 1 uses the group's own backend (gloo);
    more split each inter-node message across that many connections (``transport/tcp.py``)."""
    port_base: int = 0
    """First listening port of the multi-connection transport (each rank takes a free block
    of ``connections`` ports from here); 0 lets the kernel pick."""
    min_hierarchical_bytes: int = 0
    """Smaller messages across nodes use the stock collective. It raises the cost model's own
    thresholds (``routing.STOCK_BELOW_BYTES``); a measured plan decides the sizes it covers."""
    cuda_staging: bool = True
    """Stage CUDA tensors through pinned host memory where the group has no NCCL."""
    timeout_s: float = 300.0
    """A shared-memory wait, an inter-node transfer of the multi-connection transport or its
    set-up that makes no progress for this long raises (a peer died or called something else)."""
    debug: bool = False
    """Before every collective, check that all ranks call it with the same size and dtype."""
    overlap: bool | str = "auto"
    """Adapters issue a stack's gradient reductions asynchronously and wait where the stack
    needs their result (ZeRO-1/2/3: full buckets during backward, waited at its end; FSDP2 /
    HSDP: each layer's reduction during backward, waited at its end; Megatron DDP: each bucket's
    all-reduce as backward fills it), so the link works while the cores compute. On a CPU the
    collectives' own work competes with compute for the cores: measured on 2 cores, a net gain
    on a 100 Mbit/s link (ZeRO-2, FSDP2), a loss for ZeRO-2 on 1 Gbit/s
    (benchmarks/results/overlap_*). ``"auto"`` (the default): ZeRO-2/3, FSDP2 and Megatron DDP
    on a CPU time blocking and overlapped steps in turns in the job's first steps and keep the
    faster (``tuner/overlap.py``; the choice is cached for the next run); ZeRO-1 blocks.
    ``true`` / ``false`` force it. The results are bit-equal either way."""

    wire: str = "full"
    """The format of the cross-node stage of float collectives of at least ``wire_min_bytes``
    (inside a node everything stays full precision): ``"full"``, ``"bf16"`` (2 bytes an
    element: float32 reductions and all-gathers) or ``"int8"`` (about 1 byte an element, with a
    scale per 256: float32, fp16 and bf16). Lossy: gradient reductions carry the rounding into
    the next step (error feedback); all-gathered parameters are rounded afresh each time. What it
    costs in accuracy is measured in benchmarks/results/wire_*."""
    wire_min_bytes: int = 1 << 20
    """Smaller messages (a loss, a norm, a flag) cross at full precision whatever ``wire`` says."""

    def __post_init__(self) -> None:
        for f in fields(self):
            self.check_field(f.name, getattr(self, f.name))
        if self.small_bytes > self.slot_bytes:
            raise ValueError(f"small_bytes must be between 0 and slot_bytes ({self.slot_bytes}), "
                             f"got {self.small_bytes}")

    @classmethod
    def check_field(cls, name: str, value) -> None:
        """Refuse a bad value of field ``name`` with a ``ValueError`` that says why."""
        if name in ("slot_bytes", "chunk_bytes") and (value <= 0 or value % 64):
            raise ValueError(f"{name} must be a positive multiple of 64, got {value}")
        if name == "small_bytes" and value < 0:
            raise ValueError(f"small_bytes must be >= 0, got {value}")
        if name == "connections" and not 1 <= value <= 16:
            raise ValueError(f"connections must be between 1 and 16, got {value}")
        if name == "port_base" and not 0 <= value < 65536:
            raise ValueError(f"port_base must be a port number (or 0), got {value}")
        if name == "overlap" and value not in (True, False, "auto"):
            raise ValueError(f"overlap must be true, false or \"auto\", got {value!r}")
        if name == "wire" and value not in WIRE_FORMATS:
            raise ValueError(f"wire must be one of {', '.join(WIRE_FORMATS)}, got {value!r}")
        if name in ("min_hierarchical_bytes", "wire_min_bytes") and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        # nan and inf would switch every bounded wait off
        if name == "timeout_s" and not (math.isfinite(value) and value > 0):
            raise ValueError(f"timeout_s must be a positive finite number of seconds, got {value}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "CommConfig":
        """A group's settings when no code gives them (``resolve``): the ``SLIPSTREAM_CONFIG``
        file's ``"comm"`` part, over ``SLIPSTREAM_<FIELD>`` variables (e.g. ``SLIPSTREAM_SHM=0``),
        over the defaults; a bad value is refused naming the key and file, or the variable."""
        return cls.resolve(environ=environ)

    @classmethod
    def resolve(cls, *, code: "CommConfig | None" = None, section: Mapping[str, Any] | None = None,
                where: str = "slipstream.comm", environ: Mapping[str, str] = os.environ) -> "CommConfig":
        """The one precedence of the collectives' settings on every path: ``code`` (a whole
        ``CommConfig`` given in code) > a stack's config section (``section``, its ``"comm"``
        part; None: the ``SLIPSTREAM_CONFIG`` file's, if any) > ``SLIPSTREAM_*`` variables >
        the defaults. ``where`` names the section in errors."""
        if section is None:
            found = config_file(environ)
            if found is not None:
                path, whole = found
                require_mapping(whole, f"{path}: slipstream")
                section, where = whole.get("comm", {}), f"{path}: slipstream.comm"
        section = {} if section is None else section
        cls.values_from_dict(section, where)  # a typo is refused, even when code wins
        if code is not None:
            if not isinstance(code, CommConfig):
                raise TypeError(f"config must be a CommConfig, got {type(code).__name__}")
            return code
        return cls.from_dict(section, where, base=cls.values_from_env(environ))
