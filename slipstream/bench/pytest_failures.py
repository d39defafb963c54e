"""A pytest plugin that ``bench gpu``'s pytest stages load (``-p``): each failed test's id and
error, appended to the file ``SLIPSTREAM_PYTEST_FAILURES`` names when its report comes (one JSON
object a line). pytest prints its short summary only at the end of a run, and under pytest-xdist
not at all when the run is stopped past its time."""

from __future__ import annotations

import json
import os


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("SLIPSTREAM_PYTEST_FAILURES")
    if not path or not report.failed:
        return
    why = getattr(getattr(report.longrepr, "reprcrash", None), "message", None) or str(report.longrepr).strip()
    with open(path, "a") as f:
        f.write(json.dumps({"test": report.nodeid, "error": (why.splitlines() or [""])[0][:300]}) + "\n")
