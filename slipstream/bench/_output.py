"""Where a benchmark's results go: the table to stdout, ``--json`` and ``--markdown`` files."""

from __future__ import annotations

import json
import sys


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
