"""A flaky link for the emulated cluster: what ``tc netem`` would do on each node's link.

This kernel has no netem (``tc qdisc add ... netem``: "Specified qdisc kind is unknown"), so
the frames are impaired in user space, by the forwarder of ``_forwarder.py``; this module holds
what the impairment is, in netem's terms.
"""

from __future__ import annotations

import json
import random
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .._common.cache import read_json

__all__ = ["Impairment", "command", "parse_impairment", "read_stats", "tap_names"]


@dataclass(kw_only=True, frozen=True)
class Impairment:
    """What each node's link does to the frames the node sends (netem's terms)."""

    loss: float = 0.0
    """Fraction of frames dropped, each independently (netem ``loss 1%``)."""
    delay_s: float = 0.0
    """Delay added to every frame (netem ``delay 50ms``)."""
    jitter_s: float = 0.0
    """Each frame's delay is ``delay_s`` plus a uniform draw in +-``jitter_s``; frames whose
    draws differ by more than their spacing arrive out of order, as under netem."""
    reorder: float = 0.0
    """Fraction of frames sent at once instead of delayed, overtaking the delayed ones (netem
    ``reorder 25%``; needs a delay)."""
    seed: int = 0
    """Seed of the draws: the same seed drops the same frames of the same traffic."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be a fraction in [0, 1), got {self.loss!r}")
        if not 0.0 <= self.reorder < 1.0:
            raise ValueError(f"reorder must be a fraction in [0, 1), got {self.reorder!r}")
        if self.delay_s < 0 or not 0 <= self.jitter_s <= self.delay_s:
            raise ValueError(f"need delay >= jitter >= 0, got delay {self.delay_s!r} s, jitter {self.jitter_s!r} s")
        if self.reorder and not self.delay_s:
            raise ValueError("reorder sends some frames ahead of delayed ones: set a delay too")

    def delay_of(self, rng: random.Random) -> float | None:
        """Seconds to hold one frame, or None to drop it."""
        if self.loss and rng.random() < self.loss:
            return None
        if self.reorder and rng.random() < self.reorder:
            return 0.0
        if self.jitter_s:
            return max(0.0, self.delay_s + rng.uniform(-self.jitter_s, self.jitter_s))
        return self.delay_s


_TERM = re.compile(r"(loss|reorder)\s+(\d+(?:\.\d*)?)%|delay\s+(\d+(?:\.\d*)?)ms(?:\s+(\d+(?:\.\d*)?)ms)?|"
                   r"seed\s+(\d+)")


def parse_impairment(text: str) -> Impairment:
    """netem's words: ``"loss 1%"``, ``"delay 50ms 20ms"`` (jitter second), ``"delay 10ms reorder
    25%"``, ``"seed 3"``, any of them together."""
    fields: dict = {}
    pos, text = 0, text.strip().lower()
    while pos < len(text):
        m = _TERM.match(text, pos)
        if not m:
            raise ValueError(f"not an impairment: {text!r} at {text[pos:]!r} (e.g. 'loss 1%', "
                             f"'delay 50ms 20ms', 'delay 10ms reorder 25%')")
        if m.group(1):
            fields[m.group(1)] = float(m.group(2)) / 100
        elif m.group(3):
            fields["delay_s"] = float(m.group(3)) / 1e3
            fields["jitter_s"] = float(m.group(4) or 0) / 1e3
        else:
            fields["seed"] = int(m.group(5))
        pos = m.end()
        while pos < len(text) and text[pos] in " ,":
            pos += 1
    if not fields:
        raise ValueError("an empty impairment: say what the link does, e.g. 'loss 1%'")
    return Impairment(**fields)


def tap_names(node: int) -> tuple[str, str]:
    """(core side, node side) of node ``node``'s tap pair."""
    return f"imp{node}c", f"imp{node}n"


def command(nodes: int, impair: Impairment, stats_path: str | None) -> list[str]:
    """The forwarder's argv (to run inside the switch namespace)."""
    return [sys.executable, "-m", "slipstream.cluster._forwarder", str(nodes), json.dumps(asdict(impair)),
            *([stats_path] if stats_path else [])]


def read_stats(path: str) -> dict:
    """The forwarder's counters as last written: frames the nodes sent, dropped, delayed..."""
    return read_json(Path(path))
