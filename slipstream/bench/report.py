"""What every report of the tools shares: the machine it ran on, sizes in binary units,
markdown tables, and where the results go (the report to stdout, ``--json`` and ``--markdown``
files)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from typing import Any, Iterable, Sequence

__all__ = ["cpu_model", "emit", "format_size", "machine", "page", "parse_size", "table", "version"]

_UNIT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def cpu_model() -> str:
    """The CPU's model name from ``lscpu`` (else what ``platform`` knows)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """The machine and the versions: ``cpu``, ``cores``, ``memory_gib``, ``kernel``, ``python``,
    ``torch``."""
    import torch

    with open("/proc/meminfo") as f:
        mem_kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_gib": round(mem_kib / 2**20, 1),
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__}


def page(command: str, notes: Sequence[str], body: Sequence[str], extra: str = "") -> str:
    """A report: the machine and the versions (:func:`machine`, then ``extra``), the command,
    ``notes``, a blank line and the lines of ``body``."""
    m = machine()
    head = (f"machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; kernel {m['kernel']}, "
            f"Python {m['python']}, torch {m['torch']}" + (f", {extra}" if extra else ""))
    return "\n".join([head, f"command: {command}", *notes, "", *body, ""])


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536 (binary units K, M, G; a bare number is bytes)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNIT else ""
    try:
        value = int(float(t[: len(t) - len(unit)]) * _UNIT[unit])
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 4K, 64K, 1M, 16M)") from None
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


def format_size(nbytes: int) -> str:
    """65536 -> ``"64 KiB"``: the largest binary unit that divides ``nbytes``."""
    for unit in ("G", "M", "K"):
        if nbytes >= _UNIT[unit] and nbytes % _UNIT[unit] == 0:
            return f"{nbytes // _UNIT[unit]} {unit}iB"
    return f"{nbytes} B"


def table(columns: Sequence[str], align: str, rows: Iterable[Sequence[object]]) -> list[str]:
    """The lines of a markdown table: ``columns`` as its head, ``align`` one letter per column
    (``l`` left, ``r`` right: numbers), then one line per row of cells."""
    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(str(c) for c in cells) + " |"

    return [line(columns), "|" + "".join("---:|" if a == "r" else "---|" for a in align), *map(line, rows)]


def emit(report: str, data, args, *, indent: int = 1, show: bool = True) -> None:
    """Print ``report`` (unless not ``show``); write ``data`` as JSON to ``args.json`` and
    ``report`` to ``args.markdown`` when those options were given."""
    if show:
        sys.stdout.write(report)
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(data, f, indent=indent)
    if getattr(args, "markdown", None):
        with open(args.markdown, "w") as f:
            f.write(report)


def version(package: str) -> str | None:
    """The installed version of ``package``, read from its metadata without importing it (None:
    not installed)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
