"""The one way slipstream reads settings: a JSON-like dict (a stack's ``"slipstream"`` section),
a file of that section (``SLIPSTREAM_CONFIG``), or ``SLIPSTREAM_<FIELD>`` variables.

Every settings class (``CommConfig``, ``VarlenConfig``, ``CompileConfig``, ``SlipstreamConfig``)
is a frozen dataclass deriving from ``Settings``: ``from_dict`` checks the keys and each value's
type against the field's annotation, every error naming the bad key (``slipstream.comm.slot_bytes``),
the variable (``SLIPSTREAM_CHUNK_BYTES='100'``) or the file; ``to_dict`` writes the settings back
as JSON-able data. Booleans in the environment take 1/0, true/false, yes/no, on/off.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from typing import Any, Mapping

__all__ = ["CONFIG_VAR", "Settings", "config_file", "parse_bool", "read_section_file", "reject_unknown",
           "require_mapping", "typed"]

CONFIG_VAR = "SLIPSTREAM_CONFIG"
ENV_PREFIX = "SLIPSTREAM_"


_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off", "")
_BOOL_WORDS = _TRUE_WORDS + _FALSE_WORDS


def parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in _TRUE_WORDS:
        return True
    if low in _FALSE_WORDS:
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


class Settings:
    """Base of the settings dataclasses (``@dataclass(kw_only=True, frozen=True)``)."""

    @classmethod
    def check_field(cls, name: str, value) -> None:
        """Refuse a bad value of field ``name`` with a ``ValueError`` that says why (checks
        that need no other field; ``__post_init__`` checks the rest)."""

    @classmethod
    def from_dict(cls, section: Mapping[str, Any], where: str, *, ignore: frozenset = frozenset(),
                  base: Mapping[str, Any] | None = None):
        """``cls`` from ``section``, over the values of ``base`` (e.g. the environment's), keys
        in ``ignore`` skipped. ``where`` names the section in errors."""
        values = dict(base or {})
        values.update(cls.values_from_dict(section, where, ignore=ignore))
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def values_from_dict(cls, section: Mapping[str, Any], where: str, *, ignore: frozenset = frozenset()) -> dict:
        """The checked values of ``section``, by field name."""
        require_mapping(section, where)
        kinds = _field_kinds(cls)
        reject_unknown(section, set(kinds) | set(ignore), where)
        values = {}
        for key, value in section.items():
            if key in ignore:
                continue
            values[key] = typed(value, kinds[key], f"{where}.{key}")
            try:
                cls.check_field(key, values[key])
            except ValueError as e:
                raise ValueError(f"{where}.{key}: {e}") from None
        return values

    @classmethod
    def values_from_env(cls, environ: Mapping[str, str]) -> dict:
        """``SLIPSTREAM_<FIELD>`` (upper case) of every boolean, number or (not optional) text
        field, parsed and checked; a bad one is refused naming the variable."""
        values = {}
        for name, kinds in _field_kinds(cls).items():
            var = ENV_PREFIX + name.upper()
            raw = environ.get(var)
            kind = kinds[0]
            if raw is None or kind not in (bool, int, float) and kinds != (str,):
                continue
            try:
                # a boolean that also takes a word (``overlap``: true, false or "auto")
                word = kind is bool and str in kinds and raw.strip().lower() not in _BOOL_WORDS
                values[name] = raw.strip().lower() if word else parse_bool(raw) if kind is bool else kind(raw)
                cls.check_field(name, values[name])
            except ValueError as e:
                raise ValueError(f"{var}={raw!r}: {e}") from None
        return values

    def to_dict(self) -> dict:
        """Every field, nested settings as dicts, tuples as lists."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: value.to_dict() if isinstance(value, Settings) else list(value) if isinstance(value, tuple)
                else value for name, value in values.items()}


def _field_kinds(cls) -> dict[str, tuple]:
    """Field name -> the types its annotation allows (``NoneType`` included for optionals)."""
    hints = typing.get_type_hints(cls)
    kinds = {}
    for f in filter(lambda f: f.init, dataclasses.fields(cls)):
        hint = hints[f.name]
        union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        kinds[f.name] = typing.get_args(hint) if union else (typing.get_origin(hint) or hint,)
    return kinds


def typed(value, kinds: tuple, where: str):
    """``value`` as one of ``kinds``: JSON has no int/float distinction for whole numbers (an int
    is a float), a bool never passes as a number, a list is a tuple field's value."""
    if value is None and type(None) in kinds:
        return None
    for kind in kinds:
        if kind is type(None):
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if kind is tuple and isinstance(value, (list, tuple)):
            return tuple(value)
        if isinstance(value, kind) and not (kind is not bool and isinstance(value, bool)):
            return value
    name = next(("list" if k is tuple else k.__name__) for k in kinds if k is not type(None))
    raise ValueError(f"{where} must be {name}, got {value!r}")


def require_mapping(value, where: str) -> None:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be an object (a JSON dict), got {type(value).__name__}")


def reject_unknown(section: Mapping, allowed: set, where: str) -> None:
    unknown = sorted(set(section) - allowed, key=str)
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), sorted(allowed), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{where}: unknown key {unknown[0]!r}{hint}; allowed keys: {', '.join(sorted(allowed))}")


def read_section_file(path: str | os.PathLike) -> Mapping:
    """The ``"slipstream"`` section in a JSON or YAML file (``.yaml``/``.yml``): either the
    section itself (``{"enabled": true, "varlen": {...}}``) or a file with a top-level
    ``"slipstream"`` key (a DeepSpeed JSON). Errors name the file."""
    path = os.fspath(path)
    yaml_file = path.endswith((".yaml", ".yml"))
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{CONFIG_VAR}={path}: cannot read it ({e})") from None
    try:
        if yaml_file:
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - JSON or YAML syntax
        raise ValueError(f"{CONFIG_VAR}={path}: not valid {'YAML' if yaml_file else 'JSON'}: {e}") from None
    if isinstance(data, Mapping) and "slipstream" in data:
        data = data["slipstream"]
    return data if data is not None else {}


def config_file(environ: Mapping[str, str] = os.environ) -> tuple[str, Mapping] | None:
    """``(path, section)`` of the file ``SLIPSTREAM_CONFIG`` names, or None when it is unset."""
    path = environ.get(CONFIG_VAR)
    return (path, read_section_file(path)) if path else None
