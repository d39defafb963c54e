"""The one slipstream configuration: everything slipstream does to a training job.

Each stack carries it in its own native place (the top-level ``"slipstream"`` section of a
DeepSpeed JSON, the file ``SLIPSTREAM_CONFIG`` names for accelerate or a DDP script, Megatron's
``--slipstream-config``); every adapter reads it here, through the one settings reader::

    "slipstream": {
        "enabled": true,
        "comm":   {"shm": true, "chunk_bytes": 4194304, ...},   # fields of CommConfig
        "varlen": {"enabled": true, "backend": "auto"},         # fields of VarlenConfig
        "compile": {"enabled": true, "budget_s": 300},           # fields of CompileConfig
        "keep_freed_memory": true                               # on CPU: see cpu_memory.py
    }
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .._common.settings import Settings, config_file, read_section_file, reject_unknown, require_mapping, typed
from ..core_comm.config import CommConfig
from ..core_compile.autotune.config import CompileConfig
from ..core_compile.varlen.config import VarlenConfig

__all__ = ["SlipstreamConfig"]


@dataclass(kw_only=True, frozen=True)
class SlipstreamConfig(Settings):
    """Everything slipstream does to a training job."""

    enabled: bool = True
    """Master switch: False leaves the stock stack untouched."""
    comm: CommConfig = field(default_factory=CommConfig)
    """Collectives: routed through the core's communicator."""
    varlen: VarlenConfig | None = None
    """Padding removal; None leaves the model as it is."""
    compile: CompileConfig | None = None
    """The compile strategy chosen by measurement (``slipstream.compile``); None: no compile."""
    keep_freed_memory: bool = True
    """On a CPU accelerator, keep the memory tensors free in the process for the next step
    (``plugins.cpu_memory``): fewer page faults a step, resident memory stays at its peak."""

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None, where: str = "slipstream", *,
                  code: CommConfig | None = None, environ: Mapping[str, str] = os.environ) -> "SlipstreamConfig":
        """Parse and validate a stack's section (None: absent, so disabled); errors name the
        offending key, e.g. ``slipstream.comm.slot_bytes``. The collectives' settings, first found
        first (``CommConfig.resolve``): ``code`` (``slipstream.enable(config)``'s), the section's
        ``"comm"``, the ``SLIPSTREAM_*`` environment, the defaults."""
        if section is None:
            return cls(enabled=False)
        require_mapping(section, where)
        reject_unknown(section, {"enabled", "comm", "varlen", "compile", "keep_freed_memory"}, where)
        enabled = typed(section.get("enabled", True), (bool,), f"{where}.enabled")
        comm = CommConfig.resolve(code=code, section=section.get("comm", {}), where=f"{where}.comm", environ=environ)
        varlen = _optional_part(VarlenConfig, section, "varlen", where)
        compiled = _optional_part(CompileConfig, section, "compile", where)
        keep = typed(section.get("keep_freed_memory", True), (bool,), f"{where}.keep_freed_memory")
        return cls(enabled=enabled, comm=comm, varlen=varlen, compile=compiled, keep_freed_memory=keep)

    @classmethod
    def from_file(cls, path: str | os.PathLike, environ: Mapping[str, str] = os.environ) -> "SlipstreamConfig":
        """The config in a JSON or YAML file of the section (or with a top-level
        ``"slipstream"`` key: a DeepSpeed JSON). Errors name the file and the key."""
        return cls.from_dict(read_section_file(path), f"{os.fspath(path)}: slipstream", environ=environ)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "SlipstreamConfig | None":
        """The file named by ``SLIPSTREAM_CONFIG``, or None when the variable is unset."""
        found = config_file(environ)
        return None if found is None else cls.from_dict(found[1], f"{found[0]}: slipstream", environ=environ)


def _optional_part(cls, section: Mapping, key: str, where: str):
    """``section[key]`` as a ``cls``, or None when absent or ``"enabled": false``; a part with
    settings and no ``"enabled"`` is on."""
    part = section.get(key, {})
    require_mapping(part, f"{where}.{key}")
    part = dict(part)
    on = typed(part.pop("enabled", bool(part)), (bool,), f"{where}.{key}.enabled")
    if not on:
        return None
    return cls.from_dict(part, f"{where}.{key}", ignore=frozenset({"enabled"}))
