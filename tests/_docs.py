"""The project's documentation as the tests read it: README.md and every page under docs/,
and the JSON configs they mark ``<!-- run: examples/SCRIPT.py -->`` to be run as written."""

from __future__ import annotations

import glob
import json
import os
import re
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_MARKER = re.compile(r"<!-- run: (\S+) -->")
_MARKED_JSON = re.compile(r"<!-- run: (\S+) -->\s*```json\n(.*?)```", re.S)


class Marked(NamedTuple):
    page: str  # relative to the repository root, e.g. "docs/deepspeed.md"
    script: str  # e.g. "examples/trainer.py"
    config: dict


def doc_files() -> list[str]:
    """README.md and docs/*.md, relative to the repository root."""
    pages = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return ["README.md", *pages]


def read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def marked_configs() -> list[Marked]:
    """Every marked JSON block of every page, in page order. A marker not followed by a JSON
    block raises: a marker that matched nothing would otherwise drop its snippet silently."""
    found = []
    for page in doc_files():
        text = read(page)
        blocks = _MARKED_JSON.findall(text)
        markers = _MARKER.findall(text)
        if len(blocks) != len(markers):
            raise ValueError(f"{page}: {len(markers)} '<!-- run: -->' markers but {len(blocks)} "
                             "are followed by a ```json block")
        for script, block in blocks:
            try:
                config = json.loads(block)
            except json.JSONDecodeError as e:
                raise ValueError(f"{page}: the config marked for {script} is not JSON: {e}") from None
            found.append(Marked(page, script, config))
    return found


def configs_for(script: str) -> list[dict]:
    """The distinct configs marked for ``script`` across all pages (a config shown on two pages
    runs once)."""
    distinct: list[dict] = []
    for m in marked_configs():
        if m.script == script and m.config not in distinct:
            distinct.append(m.config)
    return distinct
