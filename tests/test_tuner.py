"""The tuner: plan choice logic, cache keying and validation without a process group; then
corrupt / stale caches, rank agreement and the budget on gloo ranks."""

import json
import time
import warnings
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from slipstream.core_comm import Choice, CommConfig, Communicator
from slipstream.plugins.deepspeed.translate import zero_buckets
from slipstream.plugins.fsdp.translate import wrap_policy_kwargs
from slipstream.core_comm.tuner import (
    SIZE_CLASSES,
    BucketSizes,
    Entry,
    TuneKey,
    TunedPlan,
    Tuner,
    TunerCacheWarning,
    load_plan,
    model_plan,
    tuned_communicator,
)
from slipstream.core_comm.tuner.tuner import _read_cache, _write_cache

KEY = TuneKey(world_size=4, node_sizes=(2, 2), paths="hierarchical", torch="2.13.0", slipstream="0.1.0")
SHM_KEY = replace(KEY, node_sizes=(4,), paths="shm")
HIER = Choice("hierarchical", 4 << 20)


def _plan(*entries, key=KEY, **kw):
    return TunedPlan(key=key, entries=[Entry(kind=k, dtype=d, nbytes=n, choice=c, source="measured")
                                       for k, d, n, c in entries], **kw)


# ---------------------------------------------------------------- pure logic


def test_plan_picks_the_nearest_measured_size_in_log_scale():
    plan = _plan(("all_reduce", "float32", 4096, Choice("stock")), ("all_reduce", "float32", 1 << 20, HIER))
    f32 = torch.float32
    assert plan.choose("all_reduce", 4096, f32) == Choice("stock")
    assert plan.choose("all_reduce", 1, f32) == Choice("stock")
    assert plan.choose("all_reduce", 60 << 10, f32) == Choice("stock")  # 2^15: nearer 2^12 than 2^20
    assert plan.choose("all_reduce", 64 << 10, f32) == Choice("stock")  # 2^16: a tie takes the smaller
    assert plan.choose("all_reduce", 200 << 10, f32) == HIER            # 2^17: nearer 2^20
    assert plan.choose("all_reduce", 1 << 30, f32) == HIER
    assert plan.choose("all_gather", 4096, f32) is None  # no entry: the communicator's own rules


def test_plan_uses_the_first_measured_dtype_for_others():
    plan = _plan(("all_reduce", "float32", 4096, Choice("stock")),
                 ("all_reduce", "bfloat16", 4096, Choice("hierarchical")))
    assert plan.choose("all_reduce", 4096, torch.bfloat16) == Choice("hierarchical")
    assert plan.choose("all_reduce", 4096, torch.float32) == Choice("stock")
    assert plan.choose("all_reduce", 4096, torch.float64) in (Choice("stock"), Choice("hierarchical"))
    only = _plan(("all_reduce", "float32", 4096, Choice("stock")))
    assert only.choose("all_reduce", 4096, torch.float16) == Choice("stock")


def test_model_plan_shm_on_one_node_stock_for_tiny_messages_across_nodes():
    cfg = CommConfig()
    shm = model_plan(SHM_KEY, cfg)
    assert all(shm.choose(k, n, torch.float32) == Choice("shm")
               for k in ("all_reduce", "reduce_scatter", "all_gather") for n in SIZE_CLASSES)
    hier = model_plan(KEY, cfg)
    assert hier.source == "model"
    assert hier.choose("all_reduce", 4096, torch.float32) == Choice("stock")
    assert hier.choose("all_reduce", 64 << 10, torch.float32) == Choice("stock")
    assert hier.choose("all_reduce", 1 << 20, torch.float32) == Choice("hierarchical", cfg.chunk_bytes)
    assert hier.choose("all_reduce", 64 << 20, torch.bfloat16) == Choice("hierarchical", cfg.chunk_bytes)
    # allgather is sized by one rank's input: 16 KiB x 4 ranks = a 64 KiB buffer
    assert hier.choose("all_gather", 16 << 10, torch.float32) == Choice("stock")
    assert hier.choose("all_gather", 1 << 20, torch.float32) == Choice("hierarchical")
    assert hier.choose("reduce_scatter", 4096, torch.float32) == Choice("hierarchical")
    none = model_plan(replace(KEY, paths=""), cfg)
    assert none.choose("all_reduce", 1 << 20, torch.float32) is None


def test_cache_file_is_named_by_topology_and_holds_the_versions(tmp_path):
    names = {KEY.filename()}
    for change in (dict(node_sizes=(4,)), dict(node_sizes=(1, 3)), dict(world_size=8, node_sizes=(4, 4)),
                   dict(paths="shm")):
        names.add(replace(KEY, **change).filename())
    assert len(names) == 5
    assert KEY.filename() == "w4-n2x2-hierarchical.json"
    path = tmp_path / KEY.filename()
    _write_cache(path, _plan(key=KEY))
    for change in (dict(torch="2.14.0"), dict(slipstream="0.2.0"), dict(format=99)):
        newer = replace(KEY, **change)
        assert newer.filename() == KEY.filename()  # an upgrade finds the old plan: stale, re-measured
        with pytest.warns(TunerCacheWarning, match="stale"):
            assert _read_cache(path, newer) is None
    assert _read_cache(path, KEY) is not None


def test_plan_json_round_trip_and_connections_apply_only_across_nodes():
    plan = _plan(("all_reduce", "float32", 4096, Choice("stock")), ("all_gather", None, 1 << 20, Choice("hierarchical")),
                 connections=4, buckets=BucketSizes(all_reduce_bytes=2 << 20))
    back = TunedPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert back.to_json() == plan.to_json()
    assert back.choose("all_gather", 1 << 20, torch.float16) == Choice("hierarchical")
    assert plan.apply(CommConfig()).connections == 4
    assert _plan(key=SHM_KEY, connections=4).apply(CommConfig()).connections == 1
    with pytest.raises(ValueError, match="connections"):
        _plan(connections=0)


def test_bucket_sizes_as_ddp_deepspeed_and_fsdp_settings():
    b = BucketSizes(all_reduce_bytes=8 << 20, reduce_scatter_bytes=4 << 20, all_gather_bytes=2 << 20)
    assert b.ddp_kwargs() == {"bucket_cap_mb": 8.0}
    assert zero_buckets(b) == {"zero_optimization": {
        "reduce_bucket_size": 2 << 20, "allgather_bucket_size": 1 << 20, "stage3_prefetch_bucket_size": 1 << 20}}
    assert zero_buckets(b, element_size=4)["zero_optimization"]["reduce_bucket_size"] == 1 << 20
    assert wrap_policy_kwargs(b) == {"min_num_params": 1 << 20}
    with pytest.raises(ValueError, match="all_gather_bytes"):
        BucketSizes(all_gather_bytes=0)


def test_cache_file_garbage_or_other_key_is_ignored_with_a_warning(tmp_path):
    path = tmp_path / KEY.filename()
    assert _read_cache(path, KEY) is None  # absent: silently nothing
    plan = _plan(("all_reduce", "float32", 4096, Choice("stock")))
    _write_cache(path, plan)
    assert _read_cache(path, KEY) == plan.to_json()
    for garbage, why in (("{not json", "unreadable"), ('{"format": 1}', "unreadable"),
                         ('{"format": 1, "key": 3, "entries": [], "connections": 1, "buckets": {}}', "unreadable"),
                         (json.dumps(_plan(key=replace(KEY, torch="1.0")).to_json()), "stale")):
        path.write_text(garbage)
        with pytest.warns(TunerCacheWarning, match=why):
            assert _read_cache(path, KEY) is None


# ---------------------------------------------------------------- on gloo ranks


def _tune_twice_with_bad_caches(rank, world, dirs):
    """Rank 0's cache holds garbage, then a stale plan; rank 1's a valid plan of its own."""
    comm = Communicator(None)
    key = TuneKey.of(comm)
    path = f"{dirs[rank]}/{key.filename()}"
    fake = TunedPlan(key=key, entries=[Entry(kind=k, dtype="float32", nbytes=4096, choice=Choice("stock"),
                                            source="measured") for k in ("all_reduce", "all_gather")])
    with open(path, "w") as f:
        f.write("\x00garbage" if rank == 0 else json.dumps(fake.to_json()))
    tuner = Tuner(comm, budget_s=2.0, sizes=(4096, 65536), reps=2, cache_dir=dirs[rank])
    plans, caught = [], []
    for attempt in range(2):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            plans.append(tuner.tune())
        caught.append([str(w.message) for w in got if issubclass(w.category, TunerCacheWarning)])
        if rank == 0 and attempt == 0:  # now a plan made for another torch: stale
            stale = TunedPlan(key=replace(key, torch="0.0"), entries=[])
            with open(path, "w") as f:
                f.write(json.dumps(stale.to_json()))
        dist.barrier()
    again = tuner.tune()  # rank 0 wrote its measured plan on the second run: now cached
    comm.close()
    return [p.source for p in (*plans, again)], [p.to_json() for p in (*plans, again)], caught


def test_corrupt_or_stale_cache_is_remeasured_and_every_rank_gets_rank0s_plan(tmp_path):
    dirs = [str(tmp_path / f"r{r}") for r in range(2)]
    for d in dirs:
        (tmp_path / d).mkdir()
    out = run_ranks(_tune_twice_with_bad_caches, 2, dirs, timeout=120)
    (sources0, plans0, caught0), (sources1, plans1, caught1) = out
    assert sources0 == sources1 == ["measured", "measured", "cached"]
    assert plans0 == plans1  # rank 1's own (different) cache file is never read
    assert len(caught0[0]) == 1 and "unreadable" in caught0[0][0]
    assert len(caught0[1]) == 1 and "stale" in caught0[1][0]
    assert caught1 == [[], []]
    assert {e["source"] for e in plans0[0]["entries"]} == {"measured"}


def _tune_in_budget(rank, world, cache_dir, budget):
    comm = Communicator(None, config=CommConfig(timeout_s=60))
    start = time.perf_counter()
    plan = Tuner(comm, budget_s=budget, cache_dir=cache_dir).measure()
    elapsed = time.perf_counter() - start
    x = torch.full((1000,), float(rank + 1))
    tuned = Communicator(None, config=plan.apply(comm.config), plan=plan)
    tuned.all_reduce(x)
    tuned.close()
    comm.close()
    return elapsed, plan.to_json(), x.tolist()


@pytest.mark.parametrize("node_of", [(0, 0), (0, 0, 1, 1)], ids=["1x2", "2x2"])
def test_tuning_stops_at_a_tiny_budget_and_the_plan_drives_the_communicator(tmp_path, node_of):
    budget = 0.1
    world = len(node_of)
    out = run_ranks(_tune_in_budget, world, str(tmp_path), budget, timeout=120,
                    rank_env=[{"SLIPSTREAM_NODE": str(n)} for n in node_of])
    elapsed = max(e for e, _, _ in out)
    plans = [p for _, p, _ in out]
    assert all(p == plans[0] for p in plans)
    entries = plans[0]["entries"]
    sources = {(e["kind"], e["nbytes"]): e["source"] for e in entries}
    assert "measured" in sources.values()
    assert all(s == "model" for (k, n), s in sources.items() if n * (world if k == "all_gather" else 1) == 64 << 20)
    # measuring stops at the budget (0.31 s for 0.3 s measured here); slack for one step that takes
    # longer than the times so far predicted, on cores other jobs load too
    assert elapsed < budget + 2.0, elapsed
    expected = [float(sum(range(1, world + 1)))] * 1000
    assert all(x == expected for _, _, x in out)


def _tune_on_pairs(rank, world, cache_dir):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[rank // 2]
    comm = Communicator(group, config=CommConfig(timeout_s=60))
    first = Tuner(comm, budget_s=1.0, sizes=(4096, 65536), reps=2, cache_dir=cache_dir).tune()
    dist.barrier()  # both pairs wrote the one file their key names
    again = load_plan(comm, cache_dir=cache_dir)
    comm.close()
    return first.to_json(), again.source, again.to_json()


def test_tuning_on_subgroups_broadcasts_from_each_groups_first_rank(tmp_path):
    out = run_ranks(_tune_on_pairs, 4, str(tmp_path), timeout=120)
    assert out[0][0] == out[1][0] and out[2][0] == out[3][0]  # each pair agrees on its measurement
    assert all(source == "cached" for _, source, _ in out)
    # Both pairs have the same key, hence one file (the last writer's): every rank loads it.
    assert all(loaded == out[0][2] for _, _, loaded in out)
    assert out[0][2] in (out[0][0], out[2][0])


def _tune_connections(rank, world, cache_dir):
    comm = Communicator(None, config=CommConfig(timeout_s=60, connections=4))
    plan = Tuner(comm, budget_s=6.0, sizes=(4096, 1 << 20), reps=2, connections=(1, 4), cache_dir=cache_dir).measure()
    tuned = Communicator(None, config=plan.apply(comm.config), plan=plan)
    x = torch.full((300_000,), float(rank + 1))
    tuned.all_reduce(x)
    tuned.close()
    comm.close()
    return plan.to_json(), tuned.config.connections, x[:3].tolist()


def test_connections_are_measured_across_nodes_and_the_plan_config_uses_the_winner(tmp_path):
    pytest.importorskip("slipstream.core_comm.transport.tcp")
    out = run_ranks(_tune_connections, 4, str(tmp_path), timeout=120,
                    rank_env=[{"SLIPSTREAM_NODE": str(n)} for n in (0, 0, 1, 1)])
    plans = [p for p, _, _ in out]
    assert all(p == plans[0] for p in plans)
    assert set(plans[0]["connection_times_s"]) == {"1", "4"}
    assert all(k == plans[0]["connections"] for _, k, _ in out)
    assert all(x == [10.0] * 3 for _, _, x in out)


def _tuned_comm(rank, world, cache_dir):
    comm = Communicator(None)
    Tuner(comm, budget_s=1.0, sizes=(4096, 65536), reps=2, cache_dir=cache_dir).tune()
    comm.close()
    tuned = tuned_communicator(None, cache_dir=cache_dir)
    x = torch.full((5000,), float(rank + 1))
    tuned.all_reduce(x)
    source = tuned.plan.source
    tuned.close()
    return source, x[0].item()


def test_tuned_communicator_runs_the_cached_plan(tmp_path):
    out = run_ranks(_tuned_comm, 2, str(tmp_path), timeout=120)
    assert out == [("cached", 3.0), ("cached", 3.0)]


class _Clock:
    """``time.perf_counter`` of the overlap trial, advanced by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def _run_trial(trial, clock, blocking_s, overlapped_s, steps, warmup_s=5.0):
    """``steps`` steps, each taking the mode's time (the untimed warm-up steps ``warmup_s``);
    the mode each step ran in."""
    from slipstream.core_comm.tuner import overlap as ot

    modes = []
    for step in range(steps):
        modes.append(trial.overlap)
        clock.now += warmup_s if step < ot.WARMUP else overlapped_s if trial.overlap else blocking_s
        trial.step_done()
    return modes


@pytest.mark.parametrize("blocking_s, overlapped_s, chosen", [(1.0, 0.9, True), (1.0, 0.99, False), (1.0, 1.3, False)],
                         ids=["10%-faster", "1%-faster", "slower"])
def test_overlap_trial_times_both_modes_in_turns_and_keeps_overlap_only_when_measurably_faster(
        monkeypatch, tmp_path, blocking_s, overlapped_s, chosen):
    from slipstream.core_comm.tuner import overlap as ot

    clock = _Clock()
    monkeypatch.setattr(ot, "time", clock)
    monkeypatch.setenv("SLIPSTREAM_OVERLAP_DIR", str(tmp_path))
    trial = ot.OverlapTrial("test buckets", {"model": 1})
    decided = []
    trial.on_decided = decided.append
    modes = _run_trial(trial, clock, blocking_s, overlapped_s, 2 * ot.ROUNDS + ot.WARMUP + 3)
    # blocking first, one overlapped warm-up, then the two in turns; the choice from then on
    assert modes == [False, True] + [False, True] * ot.ROUNDS + [chosen] * 3, modes
    assert trial.choice is chosen and decided == [trial]
    assert (f"{overlapped_s:.3f} s overlapped against {blocking_s:.3f} s blocking" in trial.reason
            and ("overlapped (measured" if chosen else "blocking (measured") in trial.reason), trial.reason


def test_overlap_trial_choice_is_cached_per_key_and_link(monkeypatch, tmp_path):
    from slipstream.core_comm.tuner import overlap as ot

    clock = _Clock()
    monkeypatch.setattr(ot, "time", clock)
    monkeypatch.setenv("SLIPSTREAM_OVERLAP_DIR", str(tmp_path))
    monkeypatch.setenv("SLIPSTREAM_LINK", "100mbit")
    first = ot.OverlapTrial("test buckets", {"model": 1})
    assert first.pending == "auto (in trial)" and "timed blocking and overlapped in turns" in first.reason
    _run_trial(first, clock, 1.0, 0.5, 2 * ot.ROUNDS + ot.WARMUP)
    assert first.choice is True and len(list(tmp_path.iterdir())) == 1
    again = ot.OverlapTrial("test buckets", {"model": 1})
    decided = []
    again.on_decided = decided.append  # set after the choice was taken: called at once
    # taken when the trial is made: the start line names the cached mode, not a trial
    assert again.pending is True and again.choice is True and decided == [again]
    assert again.reason.startswith("overlap auto: test buckets overlapped (cached from an earlier run"), again.reason
    assert "0.500 s overlapped against 1.000 s blocking" in again.reason
    # the next run: overlapped from its first step, no trial, whatever its steps take
    assert _run_trial(again, clock, 0.5, 1.0, 4) == [True, True, True, True] and decided == [again]
    for key, link in (({"model": 2}, "100mbit"), ({"model": 1}, "1gbit")):  # another model, another link
        monkeypatch.setenv("SLIPSTREAM_LINK", link)
        other = ot.OverlapTrial("test buckets", key)
        assert other.pending == "auto (in trial)"
        assert _run_trial(other, clock, 1.0, 0.5, 3) == [False, True, False] and other.choice is None


def _trial_with_cache(rank, world, cached_on):
    """Each rank's first mode, start-line word and choice when ranks ``cached_on`` hold a cached
    choice (overlapped) and the others none."""
    from slipstream.core_comm.tuner import overlap as ot

    where = ot.OverlapTrial("test buckets", {"model": 1}, dist.group.WORLD, cache=False)  # its file, uncached
    if rank in cached_on:
        ot.write_json(where._path(), {"key": where.key, "overlap": True, "blocking_s": 1.0, "overlapped_s": 0.5})
    trial = ot.OverlapTrial("test buckets", {"model": 1}, dist.group.WORLD)
    return trial.overlap, trial.pending, trial.choice


def test_a_cached_overlap_choice_holds_from_the_first_step_only_where_every_rank_has_it(tmp_path):
    """The ranks agree on a cached choice when the trial is made: every rank holding it runs
    its first step in the cached mode; where one rank lacks it, every rank trials (a rank whose
    first step ran in the other mode would issue other collectives than its peers)."""
    rank_env = [{"SLIPSTREAM_OVERLAP_DIR": str(tmp_path / f"rank{r}"), "SLIPSTREAM_LINK": "100mbit"} for r in range(2)]
    assert run_ranks(_trial_with_cache, 2, (0, 1), rank_env=rank_env) == [(True, True, True)] * 2
    rank_env[1]["SLIPSTREAM_OVERLAP_DIR"] = str(tmp_path / "empty")
    assert run_ranks(_trial_with_cache, 2, (0,), rank_env=rank_env) == [(False, "auto (in trial)", None)] * 2
