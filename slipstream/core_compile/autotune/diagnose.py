"""What a user needs to fix their model for ``torch.compile``: graph breaks and recompiles.

- Graph breaks come from ``torch._dynamo.explain`` on the first batch: each with its reason
  and the user's file:line. explain resets dynamo's caches, so it runs before anything of
  ours is compiled (other compiled code of the process compiles again at its next call).
- Recompiles are counted by the strategies' backend; their reasons (the guard that failed)
  are read from dynamo's ``recompiles`` log while a compiled forward runs, caught here and
  not printed.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

__all__ = ["GraphBreak", "graph_breaks", "list_breaks", "one_line", "watch_recompiles"]


@dataclass(frozen=True)
class GraphBreak:
    reason: str
    where: str
    """``file:line`` of the user's code where the graph was cut (innermost frame)."""


def graph_breaks(forward, args, kwargs) -> tuple[int, list[GraphBreak]]:
    """(number of graphs, breaks) of one call of ``forward`` under dynamo. Runs it once more
    (without gradients); callers put back any state it changes."""
    with torch.no_grad():
        out = torch._dynamo.explain(forward)(*args, **kwargs)
    breaks = []
    for r in out.break_reasons:
        frame = r.user_stack[-1] if r.user_stack else None
        where = f"{frame.filename}:{frame.lineno}" if frame is not None else "?"
        breaks.append(GraphBreak(" ".join(str(r.reason).split())[:300], where))
    return out.graph_count, list(dict.fromkeys(breaks))  # each break once, in order


def list_breaks(module: torch.nn.Module, forward, args, kwargs) -> tuple[int | None, list[GraphBreak]]:
    """``graph_breaks`` of ``module``'s ``forward`` with its state (buffers, the RNG) put back
    after; when the trace fails, no count and one entry saying why (a report, never a reason
    to stop the run)."""
    from .check import same_start

    try:
        with same_start(module):
            return graph_breaks(forward, args, kwargs)
    except Exception as e:  # noqa: BLE001
        return None, [GraphBreak(f"explain failed: {type(e).__name__}: {e}"[:300], "?")]


class _Catch(logging.Handler):
    def __init__(self, sink: list) -> None:
        super().__init__(logging.DEBUG)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        lines = record.getMessage().splitlines()
        if any("BACKEND_MATCH" in line for line in lines):
            return  # another candidate's entry for the same code: the search's doing, not the model's
        # "Recompiling function forward in f.py:12" / "triggered by ..." / "- 0/0: <guard>"
        guards = [line.strip().lstrip("- ").strip() for line in lines[2:] if line.strip()]
        self.sink.append(f"{lines[0].removeprefix('Recompiling function ')}: {'; '.join(guards)[:300]}")


@contextlib.contextmanager
def watch_recompiles(sink: list):
    """Append each recompile's reason to ``sink`` while inside (dynamo logs them only when its
    ``recompiles`` artifact is on: it is turned on here, and put back at exit)."""
    try:
        from torch._dynamo.guards import recompiles_log
        from torch._logging._internal import log_state
    except ImportError:  # another torch: counts still come from the backend
        yield
        return
    was_on = "recompiles" in log_state.artifact_names
    handler = _Catch(sink)
    level, propagate = recompiles_log.level, recompiles_log.propagate
    log_state.enable_artifact("recompiles")
    recompiles_log.addHandler(handler)
    recompiles_log.setLevel(logging.DEBUG)
    recompiles_log.propagate = was_on  # printed only where the user asked for it
    try:
        yield
    finally:
        recompiles_log.removeHandler(handler)
        recompiles_log.setLevel(level)
        recompiles_log.propagate = propagate
        if not was_on:
            log_state.artifact_names.discard("recompiles")


def one_line(e: BaseException) -> str:
    """One line: the error, or for a backend's failure the backend's own error."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip() and not line.startswith("Set TORCHDYNAMO")]
    if len(lines) > 1 and lines[0].endswith("raised:"):
        return lines[1][:300]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]
