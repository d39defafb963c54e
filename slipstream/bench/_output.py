"""What every benchmark report shares: the machine it ran on, and where the results go (the
table to stdout, ``--json`` and ``--markdown`` files)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys


def cpu_model() -> str:
    """The CPU's model name from ``lscpu`` (else what ``platform`` knows)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def machine_line(m: dict, extra: str = "") -> str:
    """The report's first line: the machine (``bench.comm._machine()``) and the versions."""
    return (f"machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; kernel {m['kernel']}, "
            f"Python {m['python']}, torch {m['torch']}" + (f", {extra}" if extra else ""))


def emit(report: str, data, args, *, indent: int = 1) -> None:
    """Print ``report``; write ``data`` as JSON to ``args.json`` and ``report`` to
    ``args.markdown`` when those options were given."""
    sys.stdout.write(report)
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(data, f, indent=indent)
    if getattr(args, "markdown", None):
        with open(args.markdown, "w") as f:
            f.write(report)
