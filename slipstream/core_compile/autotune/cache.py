"""The compile decision on disk, so the next run of the same job skips the search.

Keyed by what the decision depends on: the model's structure (module classes, parameter
shapes and dtypes), the first batch's shapes and dtypes, the device (and, on CPU, the
processor's name), and the versions of torch, Python and slipstream. Anything else is a new
key, so a changed model or an upgraded torch searches again. One small JSON file per key.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Mapping

import torch

from ..._common.cache import cache_dir, read_json, versions, write_json

__all__ = ["cache_key", "default_dir", "load", "signature", "store"]


def default_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """``SLIPSTREAM_COMPILE_DIR``, else ``$XDG_CACHE_HOME/slipstream/compile``, else ``~/.cache/...``."""
    return cache_dir("compile", "SLIPSTREAM_COMPILE_DIR", environ)


def _processor() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def signature(value) -> object:
    """The shapes and dtypes of the tensors in ``value`` (nested tuples, lists and mappings; any
    other leaf by its type's name), JSON-able."""
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype)]
    if isinstance(value, Mapping):
        return {str(k): signature(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (tuple, list)):
        return [signature(v) for v in value]
    return type(value).__name__


def cache_key(model: torch.nn.Module, args, kwargs, device: torch.device, extra: Mapping = ()) -> dict:
    """Everything the decision depends on, as a JSON-able dict (its hash names the file)."""
    structure = [f"{name}:{type(m).__name__}" for name, m in model.named_modules()]
    params = [f"{name}:{list(p.shape)}:{p.dtype}:{p.requires_grad}" for name, p in model.named_parameters()]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else _processor()
    return {
        "model": hashlib.sha256("\n".join(structure + params).encode()).hexdigest()[:16],
        "model_class": type(model).__name__,
        "inputs": signature([args, kwargs]),
        "device": f"{device.type}: {device_name}",
        **versions(),
        **dict(extra),
    }


def _path(directory: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return directory / f"{key['model_class']}-{digest}.json"


def load(directory: Path, key: dict) -> dict | None:
    """The stored decision for ``key``, or None (none stored, unreadable, or for another key)."""
    try:
        entry = read_json(_path(directory, key))
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) and entry.get("key") == key else None


def store(directory: Path, key: dict, decision: dict) -> Path | None:
    """Write atomically; a cache that cannot be written is skipped (returns None)."""
    path = _path(directory, key)
    try:
        write_json(path, {"key": key, **decision})
    except OSError:
        return None
    return path
