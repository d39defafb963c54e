"""Where slipstream keeps what it measured or built for the next run, and how it writes it.

Every cache lives under one directory (``cache_dir``), one folder per kind (``tuner``,
``compile``, ``tokenizer``). Files are written atomically: a reader sees the old file or the
new one, never half of one, whatever ranks or test workers write at the same time.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

from .version import __version__

__all__ = ["cache_dir", "read_json", "versions", "write_atomic", "write_json"]


def cache_dir(kind: str, override: str | None = None, environ: Mapping[str, str] = os.environ) -> Path:
    """The folder of cache ``kind``: ``environ[override]`` if set, else
    ``$XDG_CACHE_HOME/slipstream/<kind>``, else ``~/.cache/slipstream/<kind>``."""
    if override and environ.get(override):
        return Path(environ[override])
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "slipstream" / kind


def write_atomic(path: Path, write: Callable[[str], None]) -> None:
    """Create ``path`` through ``write(temporary path)``, then rename it into place. Raises
    ``OSError`` when the folder cannot be made or written (callers decide whether that matters)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json(path: Path, data: Any) -> None:
    """``data`` as JSON at ``path``, atomically (see ``write_atomic``)."""
    write_atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8"))


def read_json(path: Path) -> Any:
    """The JSON at ``path``; ``FileNotFoundError`` when absent, ``ValueError`` when unreadable."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def versions() -> dict:
    """The versions a cached decision is valid for: torch, Python and slipstream."""
    import torch

    return {"torch": torch.__version__, "python": platform.python_version() or sys.version.split()[0],
            "slipstream": __version__}
