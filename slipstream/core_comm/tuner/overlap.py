"""``"overlap": "auto"``: blocking and overlapped steps timed in turns, the faster kept.

On a CPU the collectives' own work competes with compute for the cores, so whether a stack's
reductions should run while backward goes on depends on the link, the model and the machine:
measured on 2 cores, overlap gained on a 100 Mbit/s link and lost for ZeRO-2 on 1 Gbit/s
(benchmarks/results/overlap_*). An adapter that can run a step either way holds one
``OverlapTrial`` and calls ``step_done()`` at the same point of every optimizer step on every
rank of ``group``; before each step it reads ``overlap`` (the mode to run it in).

The trial, as the compile autotuner's search: ``WARMUP`` steps untimed (the first of each
mode pays its one-time costs), then ``ROUNDS`` steps of each mode in turns; each step's time
is the slowest rank's (one all-reduce of the times, so every rank takes the same decision);
overlap is kept when its median step is at least ``MIN_GAIN`` faster than blocking's, else
blocking (the stacks' own behaviour). Both modes reduce the same values in the same order:
the results are bit-equal whichever runs. The choice is written to the cache under the
adapter's key (the model, the batch, the layout, the link) and a later run with the same key
on every rank takes it without a trial, from its first step: the ranks agree on it when the
trial is made (one all-reduce over ``group``, where every rank builds the adapter), so no step
runs in the other mode first (a blocking first step at DeepSpeed's whole-model buckets held
ZeRO-3's peak memory 10% above stock's). ``reason`` says which and why.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import statistics
import time
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from ..._common.cache import cache_dir, read_json, versions, write_json

__all__ = ["MIN_GAIN", "ROUNDS", "WARMUP", "OverlapTrial", "overlap_cache_dir"]

WARMUP = 2
"""Untimed steps first: one blocking, one overlapped (allocations, threads, the first pass)."""
ROUNDS = 3
"""Timed steps of each mode."""
MIN_GAIN = 0.03
"""Overlap is kept only when its median step is at least this much faster than blocking's."""

_CODES = {None: 0, False: 1, True: 2}


def overlap_cache_dir(environ: Mapping[str, str] = os.environ):
    """Where the choices are kept: ``SLIPSTREAM_OVERLAP_DIR``, else the cache's ``overlap``."""
    return cache_dir("overlap", "SLIPSTREAM_OVERLAP_DIR", environ)


class OverlapTrial:
    """The overlap choice of one adapter instance (a ZeRO optimizer, an FSDP2 ``apply``)."""

    def __init__(self, what: str, key: Mapping[str, Any], group=None, *, cache: bool = True) -> None:
        self.what = what
        """The stack's reductions, as the reason names them (``"ZeRO-2 gradient buckets"``)."""
        self.key = {**key, "link": os.environ.get("SLIPSTREAM_LINK", ""), "host": socket.gethostname(),
                    **versions()}
        """What the choice is valid for: the adapter's key, the link and this machine."""
        self.group = group
        self.cache = cache
        self.overlap = False
        """The mode of the step now running (a trial's first step blocks; a cached choice from the
        first step on)."""
        self.choice: bool | None = None
        """The decision, once made (None: still in trial)."""
        trial = f"timed blocking and overlapped in turns ({WARMUP} untimed steps, then {ROUNDS} of each)"
        self._on_decided: Callable[[OverlapTrial], None] | None = None
        self.reason = f"overlap auto: {what} {trial}"
        self.steps = 0
        self.times: dict[bool, list[float]] = {False: [], True: []}
        self._last: float | None = None
        taken = self._take_cached(self._read_cache())  # collective: every rank builds its adapter's trial
        self.pending: bool | str = self.choice if taken else "auto (in trial)"
        """What the start line says of the mode before the first step: the cached choice, or
        that a trial decides it."""

    @property
    def on_decided(self) -> Callable[[OverlapTrial], None] | None:
        """Called once the choice is made (measured or cached); at once if it is already."""
        return self._on_decided

    @on_decided.setter
    def on_decided(self, call: Callable[[OverlapTrial], None] | None) -> None:
        self._on_decided = call
        if call is not None and self.choice is not None:
            call(self)

    # ------------------------------------------------------------------------ the steps

    def step_done(self) -> None:
        """One optimizer step ended on this rank: time it, pick the next step's mode, decide
        when the trial is complete. Collective over ``group`` at the first and the deciding step."""
        now = time.perf_counter()
        if self.choice is not None:
            return
        if self.steps >= WARMUP:
            self.times[self.overlap].append(now - (self._last or now))
        self.steps += 1
        self._last = time.perf_counter()
        if min(len(t) for t in self.times.values()) >= ROUNDS:
            self._decide()
        else:
            # step 1 overlapped (untimed), then blocking and overlapped in turns
            self.overlap = self.steps % 2 == 1

    def _decide(self) -> None:
        n = ROUNDS
        slowest = self._max_over_ranks(self.times[False][:n] + self.times[True][:n])
        blocking, overlapped = statistics.median(slowest[:n]), statistics.median(slowest[n:])
        gain = 1.0 - overlapped / blocking if blocking > 0 else 0.0
        self._set(gain >= MIN_GAIN, blocking, overlapped, "measured")
        if self.cache:
            try:
                write_json(self._path(), {"key": self.key, "overlap": self.choice,
                                          "blocking_s": blocking, "overlapped_s": overlapped})
            except OSError:
                pass  # the next run trials again

    def _set(self, choice: bool, blocking: float, overlapped: float, how: str) -> None:
        self.choice = self.overlap = choice
        gain = 1.0 - overlapped / blocking if blocking > 0 else 0.0
        self.reason = (f"overlap auto: {self.what} {'overlapped' if choice else 'blocking'} ({how}: a step took "
                       f"{overlapped:.3f} s overlapped against {blocking:.3f} s blocking, "
                       f"{abs(gain):.0%} {'faster' if gain >= 0 else 'slower'}; kept from {MIN_GAIN:.0%} faster)")
        if self._on_decided is not None:
            self._on_decided(self)

    # ------------------------------------------------------------------------ the cache

    def _path(self):
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True, default=str).encode()).hexdigest()[:20]
        return overlap_cache_dir() / f"{digest}.json"

    def _read_cache(self) -> dict | None:
        """This rank's cached choice for ``key``, or None."""
        if not self.cache:
            return None
        try:
            data = read_json(self._path())
            if data.get("key") == json.loads(json.dumps(self.key, default=str)) and "overlap" in data:
                return data
        except (OSError, ValueError, AttributeError):
            pass
        return None

    def _take_cached(self, cached: dict | None) -> bool:
        """Take ``cached`` (this rank's, or None) where every rank has the same one (one
        all-reduce); else False."""
        code = _CODES[None if cached is None else bool(cached["overlap"])]
        most, least = self._max_over_ranks([code, -code])
        if cached is None or most != -least:
            return False
        self._set(bool(cached["overlap"]), float(cached["blocking_s"]), float(cached["overlapped_s"]),
                  "cached from an earlier run")
        return True

    def _max_over_ranks(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float32)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()
