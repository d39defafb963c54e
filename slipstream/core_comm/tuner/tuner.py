"""Measured choices for the communicator: per (collective, size, dtype) on one topology, the
algorithm and the hierarchical chunk; topology-wide, the TCP connections per inter-node peer.

    comm = tuned_communicator(group)    # collective: a Communicator running the cached plan
    comm.plan.buckets.ddp_kwargs()      # {"bucket_cap_mb": ...}; stacks: plugins/<stack>/translate.py
    plan = load_plan(comm)              # collective: the cache, else the cost model; no measuring
    plan = Tuner(comm).tune()           # collective: the cache, else measure (<= budget_s), cache
    comm = Communicator(group, config=plan.apply(config), plan=plan)  # plan.connections applied

Rank 0 of the group reads the cache and decides; every rank gets the plan from one broadcast,
so ranks never disagree, whatever their disks hold. While measuring, every decision (skip a
size for the budget, confirm a winner) is taken from times all-reduced (max) over the group,
which every rank sees alike.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from ..._common.cache import cache_dir, read_json, write_json
from ..communicator import Communicator
from ..config import CommConfig
from ..ops import KINDS
from ..routing import Choice
from .measure import _candidates, _Fixed, call_collective, collective_buffers
from .model import _MODEL_BUCKETS, SIZE_CLASSES, _model_choice, model_plan
from .plan import FORMAT, BucketSizes, Entry, TunedPlan, TuneKey, _label

__all__ = ["Tuner", "TunerCacheWarning", "default_cache_dir", "load_plan", "tuned_communicator"]

log = logging.getLogger("slipstream.tuner")

CHUNK_CANDIDATES = (1 << 20, 4 << 20, 16 << 20)
CONNECTION_CANDIDATES = (1, 4)
_PRUNE_FROM = 1 << 20  # bytes; see Tuner._pruned


class TunerCacheWarning(UserWarning):
    """A cached plan was unreadable or made for something else; it is ignored."""


def default_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """``SLIPSTREAM_TUNER_DIR``, else ``$XDG_CACHE_HOME/slipstream/tuner``, else ``~/.cache/...``."""
    return cache_dir("tuner", "SLIPSTREAM_TUNER_DIR", environ)


def _read_cache(path: Path, key: TuneKey) -> dict | None:
    """The cached plan's JSON if valid for ``key``; None (with a warning unless absent)."""
    try:
        data = read_json(path)
        TunedPlan.from_json(data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"ignoring unreadable tuner cache {path}: {type(e).__name__}: {e}",
                      TunerCacheWarning, stacklevel=3)
        return None
    if data.get("format") != FORMAT or data["key"] != key.to_json():
        warnings.warn(f"ignoring stale tuner cache {path}: made for {data['key']}, this run is "
                      f"{key.to_json()}", TunerCacheWarning, stacklevel=3)
        return None
    return data


def _write_cache(path: Path, plan: TunedPlan) -> None:
    try:
        write_json(path, plan.to_json())
    except OSError as e:
        warnings.warn(f"could not write the tuner cache {path}: {e}", TunerCacheWarning, stacklevel=3)


def _broadcast_from_rank0(obj, group):
    box = [obj]
    src = 0 if group is None or group is dist.GroupMember.WORLD else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def load_plan(comm: Communicator, *, cache_dir: str | os.PathLike | None = None,
              model: bool = True) -> TunedPlan | None:
    """Collective: the cached plan for ``comm``'s topology, else the cost model (None with
    ``model=False``). Never measures."""
    key = TuneKey.of(comm)
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / key.filename()
    data = _read_cache(path, key) if comm.rank == 0 else None
    data = _broadcast_from_rank0(data, comm.group)
    if data is None:
        return model_plan(key, comm.config) if model else None
    return TunedPlan.from_json(data, source="cached")


def tuned_communicator(group: dist.ProcessGroup | None = None, *, config: CommConfig | None = None,
                       cache_dir: str | os.PathLike | None = None, checker=None, model: bool = True) -> Communicator:
    """Collective: a communicator over ``group`` running the cached plan, else the cost model
    (with ``model=False``: else no plan, the built-in rule). When the plan measured another
    connection count than ``config``'s, the communicator is built again with it (once, at
    set-up)."""
    comm = Communicator(group, config=config, checker=checker)
    plan = load_plan(comm, cache_dir=cache_dir, model=model)
    if plan is None:
        return comm
    wanted = plan.apply(comm.config)
    if wanted != comm.config:
        comm.close()
        comm = Communicator(group, config=wanted, topology=comm.topology, checker=checker)
    comm.plan = plan
    return comm


class Tuner:
    """Measures a plan for ``comm`` on its real group within ``budget_s`` seconds; collective.

    Connections first (hierarchical groups, ``budget_s >= 5``): an 8 MiB allreduce with each
    count. Then sizes smallest first, every collective at each size; a step the times so far
    predict would overrun the budget is skipped, with that collective's larger sizes (their
    entries: the cost model's). A step is one warm-up call per candidate, then ``reps`` rounds
    over them in alternating order, each call timed from a barrier; the slowest rank's median
    counts. A candidate must beat the default by ``margin`` there and again in a second round
    against the default alone, else the default stays: other jobs load these cores too, and one
    lucky round must not pick something slower."""

    __slots__ = ("comm", "budget_s", "dtypes", "sizes", "kinds", "chunks", "connections",
                 "margin", "reps", "cache_dir",
                 "_start", "_elapsed", "_history")  # agreed progress of one measurement

    def __init__(self, comm: Communicator, *, budget_s: float = 10.0,
                 dtypes: tuple[torch.dtype, ...] = (torch.float32,), sizes: tuple[int, ...] = SIZE_CLASSES,
                 kinds: tuple[str, ...] = KINDS, chunks: tuple[int, ...] = CHUNK_CANDIDATES,
                 connections: tuple[int, ...] = CONNECTION_CANDIDATES, margin: float = 0.1, reps: int = 5,
                 cache_dir: str | os.PathLike | None = None) -> None:
        if budget_s <= 0 or not 0 <= margin < 1 or reps < 1:
            raise ValueError(f"need budget_s > 0, 0 <= margin < 1, reps >= 1; got {budget_s}, {margin}, {reps}")
        if not set(kinds) <= set(KINDS) or not kinds:
            raise ValueError(f"kinds must be among {KINDS}, got {kinds}")
        if not sizes or any(not isinstance(n, int) or n <= 0 for n in sizes):
            raise ValueError(f"sizes must be positive ints of bytes, got {sizes}")
        if any(not 1 <= k <= 16 for k in connections) or any(c <= 0 or c % 64 for c in chunks):
            raise ValueError("connections must be 1-16 and chunks positive multiples of 64")
        self.comm = comm
        self.budget_s = budget_s
        self.dtypes, self.sizes, self.kinds = tuple(dtypes), tuple(sorted(sizes)), tuple(kinds)
        self.chunks, self.connections = tuple(chunks), tuple(connections)
        self.margin, self.reps = margin, reps
        self.cache_dir = Path(cache_dir if cache_dir is not None else default_cache_dir())
        self._start = self._elapsed = 0.0
        self._history: dict = {}  # (kind, dtype, label) -> [(nbytes, median s)]

    def tune(self, *, force: bool = False) -> TunedPlan:
        """The cached plan if valid for this topology and these versions, else measure and
        cache (rank 0 writes). ``force`` measures even when the cache is valid."""
        key = TuneKey.of(self.comm)
        path = self.cache_dir / key.filename()
        data = _read_cache(path, key) if self.comm.rank == 0 and not force else None
        data = _broadcast_from_rank0(data, self.comm.group)
        if data is not None:
            return TunedPlan.from_json(data, source="cached")
        plan = self.measure()
        if self.comm.rank == 0:
            _write_cache(path, plan)
        return plan

    def measure(self) -> TunedPlan:
        """Measure now (no cache); rank 0's plan is broadcast, so every rank returns the same."""
        comm, key = self.comm, TuneKey.of(self.comm)
        dist.barrier(group=comm.group)
        self._start, self._elapsed, self._history = time.perf_counter(), 0.0, {}
        runner, connections, k_times = self._pick_connections(key)
        try:
            entries = [e for dtype in self.dtypes for e in self._measure_dtype(runner, key, dtype)]
        finally:
            if runner is not comm:
                runner.close()
        plan = TunedPlan(key=key, entries=entries, connections=connections, connection_times_s=k_times,
                         buckets=_buckets(entries, key), source="measured")
        data = _broadcast_from_rank0(plan.to_json() if comm.rank == 0 else None, comm.group)
        log.info("tuned %s in %.1f s (budget %.1f s)", key.filename(), self._elapsed, self.budget_s)
        return TunedPlan.from_json(data, source="measured")

    def _measure_dtype(self, comm: Communicator, key: TuneKey, dtype: torch.dtype) -> list[Entry]:
        name, entries, stopped = str(dtype).removeprefix("torch."), [], set()
        for nbytes in self.sizes:
            for kind in self.kinds:
                out, inp = collective_buffers(kind, nbytes, dtype, comm.world)
                default, others = _candidates(comm, kind, inp, self.chunks)
                if default is None:
                    continue
                size = inp.numel() * inp.element_size()
                runs = {_label(c): c for c in [default, *self._pruned(kind, name, others, size)]}
                cost = (1 + self.reps) * sum(self._predict(kind, name, label, size) for label in runs)
                if kind in stopped or self._elapsed + cost > self.budget_s:
                    stopped.add(kind)
                    choice = _model_choice(key, comm.config, kind, size)
                    entries.append(Entry(kind=kind, dtype=name, nbytes=size, choice=choice,
                                         source="model", default=_label(default)))
                    continue
                out.zero_(), inp.zero_()
                times = self._round(comm, kind, out, inp, runs, default)
                choice = self._decide(comm, kind, out, inp, runs, default, times)
                for label, t in times.items():
                    self._history.setdefault((kind, name, label), []).append((size, t))
                entries.append(Entry(kind=kind, dtype=name, nbytes=size, choice=choice, source="measured",
                                     times_s=times, default=_label(default)))
        return entries

    def _decide(self, comm, kind, out, inp, runs, default, times) -> Choice:
        """The winner if it beats the default by ``margin`` twice, else the default."""
        dlabel = _label(default)
        best = min(times, key=times.get)
        if best == dlabel or times[best] > (1 - self.margin) * times[dlabel]:
            return default
        pair = {dlabel: default, best: runs[best]}
        cost = (1 + self.reps) * (times[best] + times[dlabel])
        if self._elapsed + cost > self.budget_s:
            return default
        again = self._round(comm, kind, out, inp, pair, default)
        return runs[best] if again[best] <= (1 - self.margin) * again[dlabel] else default

    def _pruned(self, kind, dtype, others, nbytes) -> list[Choice]:
        """Drop candidates 1.5x slower than the best at the largest size measured so far, or
        not measured there (dropped before), once that size is bandwidth-bound (>= 1 MiB):
        below, latency decides and orders flip with size (2 nodes x 2 ranks: stock 1.4x
        faster than hierarchical at 4 KiB, 1.3x slower at 1 MiB). Candidates never measured
        (a chunk count new at this size) stay."""
        mine = {label: h for (k, d, label), h in self._history.items() if k == kind and d == dtype}
        top = max((h[-1][0] for h in mine.values()), default=0)
        if top < _PRUNE_FROM:
            return others
        last = {label: h[-1][1] for label, h in mine.items() if h[-1][0] == top}
        best = min(last.values())
        return [c for c in others if _label(c) not in mine or last.get(_label(c), math.inf) <= 1.5 * best]

    def _predict(self, kind, dtype, label, nbytes) -> float:
        """Seconds per call: a line through the last two sizes measured (latency + bytes /
        bandwidth); a candidate never measured costs what the slowest measured one does."""
        h = self._history.get((kind, dtype, label), [])
        if not h:
            known = [self._predict(kind, dtype, lb, nbytes) for (k, d, lb) in self._history if k == kind and d == dtype]
            return max(known, default=1e-3)
        if len(h) == 1:
            return h[-1][1] * max(1.0, nbytes / h[-1][0])
        (n1, t1), (n2, t2) = h[-2:]
        return t2 + max(0.0, (t2 - t1) / (n2 - n1)) * (nbytes - n2)

    def _round(self, comm, kind, out, inp, runs: dict, default: Choice) -> dict[str, float]:
        """Median over ``reps`` of each candidate's slowest-rank time; updates the agreed clock."""
        plans = {label: _Fixed(None if c == default else c) for label, c in runs.items()}
        return self._timed({label: (comm, p, kind, out, inp) for label, p in plans.items()})

    def _timed(self, calls: dict) -> dict[str, float]:
        labels, group = list(calls), self.comm.group
        local = torch.zeros(len(labels), self.reps, dtype=torch.float64)
        for r in range(-1, self.reps):  # round -1 warms up
            for i in (range(len(labels)) if r % 2 == 0 else reversed(range(len(labels)))):
                comm, plan, kind, out, inp = calls[labels[i]]
                saved, comm.plan = comm.plan, plan
                try:
                    dist.barrier(group=group)
                    t0 = time.perf_counter()
                    call_collective(comm, kind, out, inp)
                    if r >= 0:
                        local[i, r] = time.perf_counter() - t0
                finally:
                    comm.plan = saved
        flat = torch.cat([local.flatten(), torch.tensor([time.perf_counter() - self._start], dtype=torch.float64)])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        self._elapsed = flat[-1].item()
        med = flat[:-1].view(len(labels), self.reps).median(dim=1).values
        return {label: med[i].item() for i, label in enumerate(labels)}

    def _pick_connections(self, key: TuneKey) -> tuple[Communicator, int, dict[str, float]]:
        """The communicator to measure the table with, its connections per peer, the times."""
        comm, cfg = self.comm, self.comm.config
        counts = sorted(set(self.connections) | {cfg.connections})
        # 1 + reps 8 MiB allreduces per count: ~0.5 s per count over 1 Gbit/s (84 ms each). A
        # hierarchical group is on Linux, where the multi-connection transport always imports.
        if key.paths != "hierarchical" or len(counts) < 2 or self.budget_s < 5:
            return comm, cfg.connections, {}
        comms = {k: comm if k == cfg.connections else
                 Communicator(comm.group, config=replace(cfg, connections=k), topology=comm.topology)
                 for k in counts}
        out, inp = collective_buffers("all_reduce", 8 << 20, torch.float32, comm.world)
        inp.zero_()
        calls = {str(k): (c, _Fixed(None), "all_reduce", out, inp) for k, c in comms.items()}
        times = self._timed(calls)
        best, mine = min(times, key=times.get), str(cfg.connections)
        if times[best] > (1 - self.margin) * times[mine]:  # as in _decide: a margin, twice
            best = mine
        elif best != mine:
            again = self._timed({mine: calls[mine], best: calls[best]})
            best = best if again[best] <= (1 - self.margin) * again[mine] else mine
        best = int(best)
        for k, c in comms.items():
            if k != best and c is not comm:
                c.close()
        return comms[best], best, times


def _buckets(entries: list[Entry], key: TuneKey) -> BucketSizes:
    """Per collective, the smallest full buffer within 80% of the best measured bandwidth, and
    at least 1 MiB: smaller buckets multiply per-bucket costs (hooks, flattening) that these
    timings of bare collectives do not see."""
    model = _MODEL_BUCKETS.get(key.paths, BucketSizes())
    sizes = {}
    for kind in KINDS:
        measured = [e for e in entries if e.kind == kind and e.source == "measured"]
        points = [(e.nbytes * (key.world_size if kind == "all_gather" else 1), e.times_s[_label(e.choice)])
                  for e in measured if e.dtype == measured[0].dtype]
        if len(points) < 2:
            sizes[kind] = getattr(model, f"{kind}_bytes")
            continue
        best = max(n / t for n, t in points)
        sizes[kind] = max(1 << 20, min(n for n, t in points if n / t >= 0.8 * best))
    return BucketSizes(**{f"{k}_bytes": v for k, v in sizes.items()})
