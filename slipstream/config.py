"""The one slipstream configuration, and its dictionary form.

Each stack carries it in its own native place (the top-level ``"slipstream"`` section of a
DeepSpeed JSON, an accelerate plugin, Megatron arguments); all of them are parsed here::

    "slipstream": {
        "enabled": true,
        "comm":   {"shm": true, "chunk_bytes": 4194304, ...},   # fields of CommConfig
        "varlen": {"enabled": true, "backend": "auto"},         # fields of VarlenConfig
        "compile": {"enabled": true, "budget_s": 300},           # fields of CompileConfig
        "keep_freed_memory": true                               # on CPU: see cpu_memory.py
    }
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from .core_comm.config import CommConfig, check_field
from .core_compile.autotune.config import CompileConfig
from .core_compile.varlen.hf_model import VarlenConfig

__all__ = ["CONFIG_VAR", "SlipstreamConfig", "config_from_env", "load_config_file", "resolve_comm"]


@dataclass(kw_only=True, frozen=True)
class SlipstreamConfig:
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
    (``slipstream.plugins.cpu_memory``): fewer page faults a step, resident memory stays at its peak."""

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None, where: str = "slipstream", *,
                  code: CommConfig | None = None, environ: Mapping[str, str] = os.environ) -> "SlipstreamConfig":
        """Parse and validate a stack's section; errors name the offending key, e.g.
        ``slipstream.comm.slot_bytes``. ``None`` means the section is absent: disabled.

        The collectives' settings, first found first (``resolve_comm``): ``code`` (a
        ``CommConfig`` from ``slipstream.enable(config)``), the section's ``"comm"`` keys, the
        ``SLIPSTREAM_*`` environment, the defaults."""
        if section is None:
            return cls(enabled=False)
        _require_mapping(section, where)
        _reject_unknown(section, {"enabled", "comm", "varlen", "compile", "keep_freed_memory"}, where)
        enabled = _typed(section.get("enabled", True), bool, f"{where}.enabled")
        comm = resolve_comm(code=code, section=section.get("comm", {}), where=f"{where}.comm", environ=environ)
        varlen = _optional_part(VarlenConfig, section, "varlen", where)
        compiled = _optional_part(CompileConfig, section, "compile", where, kinds=_COMPILE_KINDS)
        keep = _typed(section.get("keep_freed_memory", True), bool, f"{where}.keep_freed_memory")
        return cls(enabled=enabled, comm=comm, varlen=varlen, compile=compiled, keep_freed_memory=keep)


# CompileConfig fields whose default (None) does not say their type
_COMPILE_KINDS = {"strategies": list, "strategy": str, "max_autotune": bool, "cache_dir": str}


def _optional_part(cls, section: Mapping, key: str, where: str, kinds: Mapping = {}):
    """``section[key]`` as a ``cls``, or None when absent or ``"enabled": false``; a part with
    settings and no ``"enabled"`` is on."""
    part = section.get(key, {})
    _require_mapping(part, f"{where}.{key}")
    part = dict(part)
    on = _typed(part.pop("enabled", bool(part)), bool, f"{where}.{key}.enabled")
    return _dataclass_from(cls, part, f"{where}.{key}", extra={"enabled"}, kinds=kinds) if on else None


CONFIG_VAR = "SLIPSTREAM_CONFIG"


def load_config_file(path: str | os.PathLike, environ: Mapping[str, str] = os.environ) -> SlipstreamConfig:
    """The ``SlipstreamConfig`` in a JSON or YAML file (``.yaml``/``.yml``): either the section
    itself (``{"enabled": true, "varlen": {...}}``) or a file with a top-level ``"slipstream"``
    key (a DeepSpeed JSON). Errors name the file and the key."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{CONFIG_VAR}={path}: cannot read it ({e})") from None
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            import json

            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - JSON or YAML syntax
        raise ValueError(f"{CONFIG_VAR}={path}: not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'}: {e}") from None
    if isinstance(data, Mapping) and "slipstream" in data:
        data = data["slipstream"]
    return SlipstreamConfig.from_dict(data if data is not None else {}, f"{path}: slipstream", environ=environ)


def config_from_env(environ: Mapping[str, str] = os.environ) -> SlipstreamConfig | None:
    """The file named by ``SLIPSTREAM_CONFIG``, or None when the variable is unset."""
    path = environ.get(CONFIG_VAR)
    return load_config_file(path, environ) if path else None


def resolve_comm(*, code: CommConfig | None = None, section: Mapping[str, Any] | None = None,
                 where: str = "slipstream.comm", environ: Mapping[str, str] = os.environ) -> CommConfig:
    """The one precedence of the collectives' settings on every path: ``code`` (a whole
    ``CommConfig`` given in code) > a stack's config section (``where`` names it in errors) >
    ``SLIPSTREAM_*`` variables > the defaults. A bad value is refused naming its key or
    variable."""
    section = {} if section is None else section
    _require_mapping(section, where)
    by_name = {f.name: f for f in fields(CommConfig)}
    _reject_unknown(section, set(by_name), where)
    values = {}
    for key, value in section.items():
        values[key] = _typed(value, type(by_name[key].default), f"{where}.{key}")
        try:
            check_field(key, values[key])
        except ValueError as e:
            raise ValueError(f"{where}.{key}: {e}") from None
    if code is not None:  # the section is still checked: a typo there is refused, not ignored
        if not isinstance(code, CommConfig):
            raise TypeError(f"config must be a CommConfig, got {type(code).__name__}")
        return code
    try:
        return CommConfig.from_env(environ, **values)
    except ValueError as e:
        if str(e).startswith("SLIPSTREAM_"):
            raise
        raise ValueError(f"{where}: {e}") from None


def _require_mapping(value, where: str) -> None:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be an object (a JSON dict), got {type(value).__name__}")


def _reject_unknown(section: Mapping, allowed: set, where: str) -> None:
    unknown = sorted(set(section) - allowed, key=str)
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), sorted(allowed), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{where}: unknown key {unknown[0]!r}{hint}; allowed keys: {', '.join(sorted(allowed))}")


def _typed(value, kind: type, where: str):
    # JSON has no int/float distinction for whole numbers; bool must not pass as int.
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise ValueError(f"{where} must be {kind.__name__}, got {value!r}")
    return value


def _dataclass_from(cls, section, where: str, extra: set = frozenset(), kinds: Mapping = {}):
    _require_mapping(section, where)
    by_name = {f.name: f for f in fields(cls)}
    _reject_unknown(section, set(by_name) | extra, where)
    values = {k: _typed(v, kinds.get(k, type(by_name[k].default)), f"{where}.{k}") for k, v in section.items()}
    try:
        return cls(**values)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
