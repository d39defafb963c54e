"""The DeepSpeed adapter against stock DeepSpeed on the same ranks."""

import json

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from _adam import assert_close_through_adam  # noqa: E402
from _dist import run_ranks  # noqa: E402
from slipstream.config import SlipstreamConfig  # noqa: E402

# Small slots and chunks so that these small models run multi-chunk pipelines.
COMM = {"slot_bytes": 4096, "small_bytes": 512, "chunk_bytes": 4096, "timeout_s": 60}


def _ds_config(stage, gas=1, section=None, bucket=2000):
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
        "zero_force_ds_cpu_optimizer": False,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
    }
    if section is not None:
        cfg["slipstream"] = section
    return cfg


def _full_weights(engine):
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def _mlp_batches(rank, n, rows=4):
    for step in range(n):
        g = torch.Generator().manual_seed(1000 * step + rank)
        yield torch.randn(rows, 32, generator=g), torch.randn(rows, 32, generator=g)


def _train_mlp(stage, section, steps, gas, hidden=64, bucket=2000, engines=None, reads=None):
    """``reads``: a list that takes every parameter, flattened, right after each step."""
    import slipstream.deepspeed as sds

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 32))
    init = sds.initialize if section is not None else deepspeed.initialize
    cfg = _ds_config(stage, gas, section, bucket)
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=cfg)
    if engines is not None:
        engines.append(engine)
    from deepspeed.utils import safe_get_full_grad

    losses, grads = [], []
    for x, y in _mlp_batches(engine.global_rank, steps * gas):
        loss = (engine(x) - y).pow(2).mean()
        engine.backward(loss)
        if engine.is_gradient_accumulation_boundary():  # reduced, before the optimizer step
            grads.append([safe_get_full_grad(p).clone() for p in engine.module.parameters()])
        engine.step()
        if reads is not None:  # what a loop reads between the step and the next forward (an average)
            reads.append(torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]))
        losses.append(loss.item())
    return losses, grads, _full_weights(engine)


def _parity(rank, world, stage, gas, hidden=64, bucket=2000):
    from slipstream.core_comm import counters
    from slipstream.plugins.cpu_memory import is_keeping_freed_memory
    from slipstream.plugins.deepspeed import installed_backend, uninstall
    from slipstream.plugins.deepspeed.zero import is_patched

    stock_losses, stock_grads, stock_w = _train_mlp(stage, None, 4, gas, hidden, bucket)
    assert not is_keeping_freed_memory()
    engines = []
    counters.reset()
    ours_losses, ours_grads, ours_w = _train_mlp(stage, {"enabled": True, "comm": COMM}, 4, gas, hidden, bucket,
                                                 engines)
    counts = counters.snapshot()
    assert is_keeping_freed_memory()  # the CPU accelerator, and the section's default
    assert installed_backend() is not None, "the slipstream backend was not installed"
    # Gradients are reduce-scattered (ZeRO-1/2 to their owners, ZeRO-3 to its shards), and
    # ZeRO-3 gathers its parameters: the paths those calls took.
    kinds = ["reduce_scatter"] + (["all_gather"] if stage == 3 else [])
    assert all(counts.get(kind) for kind in kinds), f"no {kinds} through slipstream: {counts}"
    algos = {path for kind in kinds for path in counts[kind]}
    optimizer = engines[0].optimizer
    assert is_patched(optimizer) == (stage < 3)
    uninstall()
    assert not is_keeping_freed_memory() and not is_patched(optimizer)
    torch.testing.assert_close(torch.tensor(ours_losses), torch.tensor(stock_losses), rtol=1e-5, atol=1e-6)
    assert_close_through_adam(ours_w, stock_w, ours_grads, stock_grads, lr=1e-2)
    return sorted(algos)


def test_owner_layout_groups_slices_by_owner_and_pads_to_the_largest():
    from slipstream.plugins.deepspeed.zero import owner_layout

    # slices of 5, 3, 4, 2 elements owned by ranks 1, 0, 1, 0 (as in a bucket filled by backward)
    offsets, shard, ends = owner_layout([5, 3, 4, 2], [1, frozenset({0}), 1, 0], 2)
    assert shard == 9 and offsets == [9, 0, 14, 3] and ends == [5, 18]
    # rank 0 owns nothing: 2x padding is more than the reduce-scatter saves, so DeepSpeed's path
    assert owner_layout([5, 4], [1, 1], 2) is None
    assert owner_layout([5, 4], [frozenset({0, 1}), 1], 2) is None  # a slice with two owners
    assert owner_layout([0], [0], 2) is None
    with pytest.raises(ValueError, match="owner 2 outside the group of 2 ranks"):
        owner_layout([1], [2], 2)


@pytest.mark.parametrize("numels", [[7, 5, 12], [12]], ids=["padded-and-interleaved", "one-divisible"])
def test_zero3_deferral_lays_a_bucket_out_as_deepspeeds_reduce_scatter_coalesced(monkeypatch, numels):
    """The ZeRO-3 deferral's own reduce-scatter against DeepSpeed's
    ``reduce_scatter_coalesced`` on the same gradients, rank 1 of 3 (the call itself replaced
    by a recorder in both): the same input on every real element, the same output slice, and
    each gradient's result at the same place in it."""
    import types

    import deepspeed.comm as ds_dist
    from deepspeed.runtime.comm import coalesced_collectives

    from slipstream.plugins.deepspeed.overlap import _scatter_async

    monkeypatch.setattr(ds_dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(ds_dist, "get_world_size", lambda group=None: 3)

    def grads():
        return [torch.arange(n, dtype=torch.float32) + 100 * i + 1 for i, n in enumerate(numels)]

    theirs = {}
    monkeypatch.setattr(coalesced_collectives, "_torch_reduce_scatter_fn",
                        lambda flat, out, group=None, **_: theirs.update(flat=flat.clone(), out=out))
    their_outputs = coalesced_collectives.reduce_scatter_coalesced(grads(), None)
    ours = {}
    monkeypatch.setattr(ds_dist, "reduce_scatter_fn", lambda out, flat, group=None, async_op=False: ours.update(
        flat=flat.clone(), out=out))
    params = [types.SimpleNamespace(grad=g) for g in grads()]
    optimizer = types.SimpleNamespace(_get_param_partition_group=lambda param: None)
    our_outputs, works = _scatter_async(optimizer, params)
    assert works == []  # the recorder returned no handle, as a synchronous call does
    assert ours["flat"].shape == theirs["flat"].shape
    real = torch.cat([torch.arange(-(-n // 3)) < n - r * -(-n // 3) for r in range(3) for n in numels])
    assert torch.equal(ours["flat"][real], theirs["flat"][real]) and not ours["flat"][~real].any()
    assert ours["out"].shape == theirs["out"].shape
    assert ours["out"].storage_offset() == theirs["out"].storage_offset()
    for mine, their in zip(our_outputs, their_outputs, strict=True):
        assert (mine.storage_offset(), mine.shape) == (their.storage_offset(), their.shape)

def _env(*nodes):
    return [{"LOCAL_RANK": str(i), "SLIPSTREAM_NODE": str(n)} for i, n in enumerate(nodes)]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_matches_stock_deepspeed_losses_and_weights(stage):
    algos = run_ranks(_parity, 2, stage, 1, rank_env=_env(0, 0), timeout=400)
    assert algos[0] == ["shm"]


def test_zero2_on_two_emulated_nodes_with_grad_accumulation_matches_stock():
    # One bucket of the whole model (66592 fp32 elements, split evenly over the 4 owners, so
    # it is reduce-scattered): above the size under which the cost model keeps cross-node
    # messages on the stock collective, so gradients take the hierarchical path.
    algos = run_ranks(_parity, 4, 2, 2, 1024, 1 << 17, rank_env=_env(0, 0, 1, 1), timeout=500)
    assert algos[0] == ["hierarchical"]


def _overlap_against_blocking(rank, world, gas, depth=None):
    """ZeRO-2 with small buckets, each bucket's reduction issued during backward and with
    every reduction blocking: bit-equal results; the core's timeline says which collectives
    ran while this rank computed (hidden) and which it waited for. ``depth``: buckets in
    flight at most (less than a step's, so the oldest are finished while backward goes on).
    With overlap the parameter gather after each step goes behind the next forward, in pieces
    of 1,024 elements a rank: what the loop reads right after the step is the same too."""
    from slipstream.plugins.deepspeed import gather
    from slipstream.plugins.deepspeed import overlap as deferrals

    if depth is not None:
        deferrals.IN_FLIGHT_BUCKETS = depth
    gather.MIN_PIECE = 1024
    import slipstream
    from slipstream.core_comm import counters
    from slipstream.plugins.deepspeed import uninstall
    from slipstream.plugins.deepspeed.zero import overlaps

    runs, reads, gathers, behind = {}, {}, {}, {}
    for overlap in (False, True):
        engines, reads[overlap] = [], []
        counters.reset()
        losses, grads, weights = _train_mlp(2, {"enabled": True, "comm": {**COMM, "overlap": overlap}}, 3, gas,
                                            hidden=256, bucket=2000, engines=engines, reads=reads[overlap])
        assert overlaps(engines[0].optimizer) is overlap
        gathers[overlap] = sum(p["calls"] for p in counters.snapshot().get("all_gather", {}).values())
        behind[overlap] = slipstream.status()["stacks"]["deepspeed"]["parameters_gathered_behind_forward"]
        runs[overlap] = losses, grads, weights, counters.timeline.take()
        uninstall()
    assert all(torch.equal(a, b) for a, b in zip(reads[False], reads[True], strict=True)), \
        "parameters read right after a step differ from the blocking gather's"
    # 16,672 parameters: one gather a step blocking, behind the forward one a 1,024 elements of a
    # rank's partition (8 pieces of 1,042 on 2 ranks, 4 of 1,042 on 4), and on 2 nodes (the 4
    # ranks) first one inside each node of its own partitions
    assert (behind[False], behind[True]) == (False, True)
    pieces = min(gather.PIECES, 16672 // world // 1024) + (world == 4)
    assert (gathers[False], gathers[True]) == (3, 3 * pieces), gathers
    return _bit_equal_runs(runs[False], runs[True])


def _bit_equal_runs(blocking, overlapped):
    """Runs of ``(losses, reduced gradients per step, weights, timeline)``, blocking and
    overlapped: bit-equal losses, gradients and weights; the two timelines."""
    assert blocking[0] == overlapped[0], "losses differ from the blocking path's"
    for a, b in zip([*blocking[2], *(g for step in blocking[1] for g in step)],
                    [*overlapped[2], *(g for step in overlapped[1] for g in step)]):
        assert torch.equal(a, b), "weights or reduced gradients differ from the blocking path's"
    return blocking[3], overlapped[3]


@pytest.mark.parametrize("nodes, gas, depth", [((0, 0), 1, 2), ((0, 0, 1, 1), 2, None)],
                         ids=["1node-2-in-flight", "2nodes-grad-accum"])
def test_zero2_buckets_reduce_while_backward_computes_bit_equal_to_blocking(nodes, gas, depth):
    timelines = run_ranks(_overlap_against_blocking, len(nodes), gas, depth, rank_env=_env(*nodes), timeout=500)
    for blocking, overlapped in timelines:
        assert blocking["hidden_s"] == 0.0 and blocking["exposed_s"] > 0  # every collective held the rank
        # a bucket's reduce-scatter in flight while backward went on (the core's own timestamps)
        assert overlapped["hidden_s"] > 0, overlapped


class _Recording:
    """A communicator that records the storage of each all-gather's output."""

    def __init__(self, comm) -> None:
        self.comm, self.staged = comm, []

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def all_gather(self, output, *args, **kwargs):
        self.staged.append(output.untyped_storage().data_ptr())
        return self.comm.all_gather(output, *args, **kwargs)


def _gather_ahead(rank, world):
    """A flat buffer of ``world`` partitions (rank ``r`` holds the ``r``-th) gathered by
    ``GatherAhead`` as after a ZeRO-1/2 step, through the core's path and through the stock one:
    each piece's ranges of the other node's block, the storages the pieces' outputs were in,
    then whether the buffer is every partition in order once every piece is in."""
    import types

    from slipstream.core_comm.communicator import Communicator
    from slipstream.core_comm.config import CommConfig
    from slipstream.plugins.deepspeed import gather

    gather.MIN_PIECE = 1000
    runs = {}
    for path, config in (("core", CommConfig(timeout_s=60)), ("stock", CommConfig(timeout_s=60, shm=False))):
        comm = _Recording(Communicator(None, config=config))
        ahead = gather.GatherAhead(types.SimpleNamespace(communicator=lambda group: comm, takes=lambda *_: True),
                                   lambda: True)
        size = 8000
        flat = torch.zeros(world * size)
        mine = flat[rank * size:(rank + 1) * size]
        mine.copy_(torch.arange(rank * size, (rank + 1) * size))
        ahead.armed = True
        assert ahead.take(flat, mine, None)
        ranges = [p.ranges for p in ahead.pending]
        ahead.settle()
        comm.close()
        runs[path] = ranges, comm.staged, torch.equal(flat, torch.arange(world * size, dtype=flat.dtype))
    return runs


def test_zero_parameter_gather_sends_each_nodes_partitions_to_the_other_node_in_the_models_order():
    """ZeRO-1/2's parameter gather behind the next forward on 2 nodes of 2 ranks: each node's
    partitions are gathered inside it first, then its pieces send the other node that node's
    block (two partitions: the model's first half to node 1) from its start to its end, so
    that the first layers of a node's forward wait for the first pieces only; the buffer equals
    the plain gather's. The core's pieces, each copied out on its thread before the next runs,
    share one piece's staging; the stock collective's (gloo's thread) each have their own."""
    for rank, runs in enumerate(run_ranks(_gather_ahead, 4, rank_env=_env(0, 0, 1, 1), timeout=120)):
        (ranges, staged, equal), (_, stock_staged, stock_equal) = runs["core"], runs["stock"]
        assert equal and stock_equal, f"rank {rank}: the gathered buffer differs from every partition in order"
        other = 1 - rank // 2
        assert len(ranges) == 8 and all(len(r) == 1 for r in ranges), ranges  # one range a piece: the other node's
        spans = [r[0] for r in ranges]
        assert spans[0][0] == other * 16000 and spans[-1][1] == (other + 1) * 16000, spans
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans  # front to back, one after another
        assert len(staged) == 8 and len(set(staged)) == 1, staged
        assert len(stock_staged) == 8 and len(set(stock_staged)) == 8, stock_staged


def _auto_overlap(rank, world, stage, gas, cases, layers):
    """ZeRO-``stage`` with the default ``"overlap": "auto"``, ``gas`` micro-batches a step,
    ``layers`` layers a bucket: on a slow link (each reduce-scatter as long as a layer's
    backward) and on a fast one (no delay, and layers of longer backward: the buckets' own
    work, which an overlapped step hides, about 1% of the step; with the slow link's layers,
    ZeRO-3's was 3%, the trial's threshold). What the trial chose each time, the losses and
    weights of each run and of ``"overlap": false``, what a second run on the slow link did
    with the cached choice (``cases``: which of these run), and after each optimizer step
    whether the trial was still running."""
    import slipstream
    import slipstream.deepspeed as sds
    from _overlap_trial import LAYER, Layers, batch, slow_link
    from slipstream.core_comm.tuner import overlap as ot
    from slipstream.plugins.deepspeed import uninstall

    def train(overlap, delay_s, steps, compute_s=0.08):
        torch.manual_seed(0)
        model = Layers(compute_s=compute_s)
        # the core's own chunks (COMM's tiny ones would make a bucket 70 round trips across nodes)
        comm = {"timeout_s": 60} if overlap == "auto" else {"timeout_s": 60, "overlap": overlap}
        cfg = _ds_config(stage, gas, {"enabled": True, "comm": comm}, bucket=layers * LAYER)
        with slow_link(delay_s):
            engine, *_ = sds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            before = slipstream.status()["stacks"]["deepspeed"]["buckets_during_backward"]  # as the start line says
            first = _deferral_trial(engine)
            first = first.overlap if first is not None else overlap  # the mode the first step runs in
            coordinator = engine.optimizer._get_param_coordinator() if stage == 3 else None
            first_prefetch = getattr(coordinator, PREFETCH_BUCKET, None)  # the first step's
            losses, sizes, in_trial, prefetch = [], [], [], []
            for step in range(steps * gas):
                x, y = batch(rank, step)
                loss = (engine(x) - y).pow(2).mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                if (step + 1) % gas == 0:  # an optimizer step
                    sizes.append(engine.optimizer.reduce_bucket_size)
                    stack = slipstream.status()["stacks"]["deepspeed"]
                    in_trial.append(stack["buckets_during_backward"] == "auto (in trial)")
                    if coordinator is not None:  # the next step's parameter prefetch, with its mode
                        trial = _deferral_trial(engine)
                        mode = trial.overlap if trial is not None else overlap
                        prefetch.append((getattr(coordinator, PREFETCH_BUCKET), mode))
        facts = slipstream.status()["stacks"]["deepspeed"]
        weights = _full_weights(engine)
        uninstall()
        return {"losses": losses, "weights": weights, "overlap": facts["overlap"],
                "during_backward": facts["buckets_during_backward"], "sizes": sizes, "in_trial": in_trial,
                "before": before, "first": first, "first_prefetch": first_prefetch, "prefetch": prefetch,
                "prefetch_after": getattr(coordinator, PREFETCH_BUCKET, None)}

    def forced_on_prefetch():
        """The parameter prefetch bucket of ``"overlap": true`` (the tuner's)."""
        section = {"enabled": True, "comm": {"timeout_s": 60, "overlap": True}}
        cfg = _ds_config(stage, gas, section, bucket=layers * LAYER)
        model = Layers(compute_s=0.0)
        engine, *_ = sds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        size = engine._config.zero_config.prefetch_bucket_size
        uninstall()
        return size

    from slipstream.plugins.deepspeed.overlap import PREFETCH_BUCKET

    steps = ot.WARMUP + 2 * ot.ROUNDS + 1
    runs = {"slow link": train("auto", 0.08, steps), "fast link": train("auto", 0.0, steps, compute_s=0.25),
            "blocking": train(False, 0.0, steps, compute_s=0.0)}  # the numbers' reference: nothing timed
    if "cached" in cases:
        runs["cached"] = train("auto", 0.08, 3)
    if stage == 3:
        runs["slow link"]["forced_on_prefetch"] = forced_on_prefetch()
    blocking = runs["blocking"]["weights"]
    for run in runs.values():  # either mode reduces the same values in the same order
        n, weights = len(run["losses"]), run.pop("weights")
        run["bit_equal"] = run["losses"] == runs["blocking"]["losses"][:n] and (
            n < steps * gas or all(torch.equal(a, b) for a, b in zip(weights, blocking)))
    return runs


def _deferral_trial(engine):
    """The overlap trial of the ZeRO deferral patched onto ``engine``'s optimizer (None: none)."""
    deferral = getattr(engine.optimizer.independent_gradient_partition_epilogue, "func", None)
    return getattr(getattr(deferral, "__self__", None), "trial", None)


def _assert_auto_overlap(runs, steps_in_trial):
    slow, fast = runs["slow link"], runs["fast link"]
    # a reduce-scatter as long as a layer's backward: overlapped steps hide it; without, nothing to hide
    assert slow["during_backward"] is True and "buckets overlapped (measured" in slow["overlap"], slow["overlap"]
    assert fast["during_backward"] is False and "buckets blocking (measured" in fast["overlap"], fast["overlap"]
    assert runs["blocking"]["overlap"] == "forced off", runs["blocking"]
    if "cached" in runs:
        assert runs["cached"]["during_backward"] is True, runs["cached"]
        assert "cached from an earlier run" in runs["cached"]["overlap"], runs["cached"]
        # taken when the engine was built, every rank agreeing: its first step already overlapped,
        # not blocking at DeepSpeed's whole-model buckets first (that step set ZeRO-3's peak memory)
        assert runs["cached"]["before"] is True and runs["cached"]["first"] is True, runs["cached"]
        assert not any(runs["cached"]["in_trial"]), runs["cached"]
    assert slow["before"] == "auto (in trial)" and slow["first"] is False, slow  # a trial's first step blocks
    assert len(set(slow["sizes"])) == 1  # the config's bucket size in both modes
    # the trial counts optimizer steps, not micro-batches: decided at the end of its last one
    assert slow["in_trial"] == [True] * (steps_in_trial - 1) + [False] * (len(slow["in_trial"]) + 1 - steps_in_trial)
    assert all(run["bit_equal"] for run in runs.values()), runs


@pytest.mark.slow
def test_zero2_overlap_auto_chooses_by_measurement_caches_the_choice_and_trains_bit_equal(tmp_path):
    from slipstream.core_comm.tuner import overlap as ot

    env = {"SLIPSTREAM_OVERLAP_DIR": str(tmp_path)}
    # 2 nodes of a rank each: each layer's bucket (one owner's) goes to its owner (hierarchical path)
    for runs in run_ranks(_auto_overlap, 2, 2, 1, ("cached",), 1, rank_env=_env(0, 1), env=env, timeout=300):
        _assert_auto_overlap(runs, ot.WARMUP + 2 * ot.ROUNDS)
    assert len(list(tmp_path.iterdir())) == 2  # one choice for the model and layout on each link


@pytest.mark.slow
def test_zero3_overlap_auto_chooses_by_measurement_over_accumulated_steps_bit_equal(tmp_path):
    from slipstream.core_comm.tuner import overlap as ot

    env = {"SLIPSTREAM_OVERLAP_DIR": str(tmp_path)}
    # ZeRO-3 reduce-scatters each bucket whole (every rank's part of it), two layers a bucket
    # for a size the core's path takes across nodes, 2 micro-batches a step
    for runs in run_ranks(_auto_overlap, 2, 3, 2, ("cached",), 2, rank_env=_env(0, 1), env=env, timeout=300):
        _assert_auto_overlap(runs, ot.WARMUP + 2 * ot.ROUNDS)
    assert len(list(tmp_path.iterdir())) == 2
    # each choice is keyed by the model's full size, though ZeRO-3 leaves its parameters empty
    from _overlap_trial import Layers

    full = sum(p.numel() for p in Layers(compute_s=0.0).parameters())
    assert {json.loads(f.read_text())["key"]["params"] for f in tmp_path.iterdir()} == {full}
    # the parameter prefetch follows each step's mode: DeepSpeed's own in blocking steps (as
    # "overlap": false has it), the tuner's (as "overlap": true has it) in overlapped ones
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    default = DeepSpeedZeroConfig(stage=3).prefetch_bucket_size
    slow, fast = runs["slow link"], runs["fast link"]
    tuned = slow["forced_on_prefetch"]
    assert tuned < default
    for run in (slow, fast, runs["blocking"]):
        assert all(size == (tuned if mode else default) for size, mode in run["prefetch"]), run["prefetch"]
        assert run["prefetch_after"] == default  # put back with the patches
    trial_steps = ot.WARMUP + 2 * ot.ROUNDS - 1
    assert {mode for _, mode in slow["prefetch"][:trial_steps]} == {True, False}, slow["prefetch"]
    assert slow["prefetch"][-1] == (tuned, True) and fast["prefetch"][-1] == (default, False)
    # the cached choice's first step gathers ahead in the overlapped mode's bucket; a trial's blocks
    assert runs["cached"]["first_prefetch"] == tuned and slow["first_prefetch"] == default, runs["cached"]


def _zero3_gathers(rank, world):
    """ZeRO-3 with DeepSpeed's prefetch bucket (the whole model) and with ``overlap`` (the
    tuner's all-gather bucket, about one layer here): the same losses and weights; per step,
    once the trace is recorded, one all-gather against one a bucket ahead; hidden time."""
    import slipstream.deepspeed as sds
    from slipstream.core_comm import counters
    from slipstream.plugins.deepspeed import uninstall

    def gathers() -> int:
        return sum(p["calls"] for kind, paths in counters.snapshot().items() if "all_gather" in kind
                   for p in paths.values())

    runs = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 512), *[torch.nn.Linear(512, 512) for _ in range(4)],
                                    torch.nn.Linear(512, 32))
        cfg = _ds_config(3, 1, {"enabled": True, "comm": {**COMM, "overlap": overlap}})
        engine, *_ = sds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        losses, per_step = [], []
        for step, (x, y) in enumerate(_mlp_batches(engine.global_rank, 4)):
            if step == 2:  # the trace is recorded in the first step
                counters.timeline.take()
            before = gathers()
            loss = (engine(x) - y).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            per_step.append(gathers() - before)
        bucket = engine._config.zero_config.prefetch_bucket_size
        runs[overlap] = losses, per_step, _full_weights(engine), counters.timeline.take()["hidden_s"], bucket
        uninstall()
    blocking, overlapped = runs[False], runs[True]
    assert blocking[0] == overlapped[0], "losses differ from the default prefetch's"
    assert all(torch.equal(a, b) for a, b in zip(blocking[2], overlapped[2])), "weights differ"
    return blocking[1][2:], blocking[4], overlapped[1][2:], overlapped[4], overlapped[3]


@pytest.mark.slow
def test_zero3_gathers_parameters_a_bucket_ahead_with_overlap_bit_equal_to_the_default():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from slipstream.core_comm.tuner.model import _MODEL_BUCKETS

    default = DeepSpeedZeroConfig(stage=3).prefetch_bucket_size
    ahead = _MODEL_BUCKETS["hierarchical"].all_gather_bytes // 4  # fp32 elements, 2 nodes x 1 rank
    for blocking, blocking_bucket, overlapped, bucket, hidden in run_ranks(_zero3_gathers, 2, rank_env=_env(0, 1),
                                                                            timeout=500):
        assert (blocking_bucket, bucket) == (default, ahead)
        # DeepSpeed's bucket takes the whole model (1.1M elements) in one prefetch; the tuner's
        # one layer of 512 x 512: more all-gathers a step, each issued while the layer before computes
        assert all(b < o for b, o in zip(blocking, overlapped)), (blocking, overlapped)
        assert hidden > 0  # an all-gather in flight while this rank computed (the core's timestamps)


def _zero3_reduces(rank, world):
    """ZeRO-3 with every gradient bucket's reduce-scatter blocking (DeepSpeed's) and issued
    during backward (``overlap``), parameters prefetched in one bucket in both (once the trace
    is recorded, one all-gather a step, waited for at the first layer: any collective in
    flight while backward computes is a gradient reduction): bit-equal losses, reduced
    gradients and weights; the core's timeline of each from the third step on, and how many
    buckets were issued and still in flight when backward went on."""
    import slipstream.deepspeed as sds
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.utils import safe_get_full_grad

    from slipstream.core_comm import counters
    from slipstream.plugins.deepspeed import uninstall
    from slipstream.plugins.deepspeed.zero import overlaps

    runs = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 512), *[torch.nn.Linear(512, 512) for _ in range(4)],
                                    torch.nn.Linear(512, 32))
        cfg = _ds_config(3, 1, {"enabled": True, "comm": {"timeout_s": 60, "overlap": overlap}}, bucket=300_000)
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = DeepSpeedZeroConfig(stage=3).prefetch_bucket_size
        engine, *_ = sds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        assert overlaps(engine.optimizer) is overlap
        losses, grads = [], []
        for step, (x, y) in enumerate(_mlp_batches(engine.global_rank, 5, rows=1024)):
            if step == 2:  # the trace is recorded in the first step
                counters.timeline.take()
            loss = (engine(x) - y).pow(2).mean()
            engine.backward(loss)
            grads.append([safe_get_full_grad(p).clone() for p in engine.module.parameters()])
            engine.step()
            losses.append(loss.item())
        timeline = counters.timeline.take()
        deferred = getattr(engine.optimizer.independent_gradient_partition_epilogue, "func", None)
        timeline["buckets"] = (deferred.__self__.issued, deferred.__self__.running_on) if deferred else (0, 0)
        runs[overlap] = losses, grads, _full_weights(engine), timeline
        uninstall()
    return _bit_equal_runs(runs[False], runs[True])


def test_zero3_gradient_buckets_reduce_while_backward_computes_bit_equal_to_blocking():
    # Buckets of 300,000 elements: one or two 512 x 512 layers each, the biases in the
    # contiguous buffer, the large weights alone in their own gradient.
    for blocking, overlapped in run_ranks(_zero3_reduces, 2, rank_env=_env(0, 1), timeout=500):
        issued, running_on = overlapped["buckets"]
        assert blocking["buckets"] == (0, 0) and issued >= 2 * 5, (blocking, overlapped)  # several a step
        # reduce-scatters still in flight (the core's Work) when backward went on, and so more
        # time with a collective in flight while no caller waited (the core's timestamps)
        # than the blocking run's, whose only such time is the prefetch's
        assert running_on > 0 and overlapped["hidden_s"] > blocking["hidden_s"], (blocking, overlapped)


_PATCHED_DEEPSPEED = ("deepspeed.runtime.engine", "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3",
                      "deepspeed.runtime.zero.partition_parameters", "deepspeed.runtime.zero.parameter_offload",
                      "deepspeed.runtime.comm.coalesced_collectives", "deepspeed.comm.comm", "deepspeed.comm.torch")


def _deepspeed_functions() -> dict:
    """Every function, class, method and the communication backend that DeepSpeed's modules
    and their classes hold (and torch's file baton, which the adapter also patches), by
    where they are held."""
    import sys
    from types import ModuleType

    held = {}
    names = [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")] + ["torch.utils.file_baton"]
    for name in sorted(names):
        module = sys.modules[name]
        if not isinstance(module, ModuleType):
            continue
        for key, value in list(vars(module).items()):
            if callable(value) or key == "cdb":
                held[f"{name}.{key}"] = value
            if isinstance(value, type) and value.__module__ == name:
                for attr, member in list(vars(value).items()):  # its methods, not its counters
                    if callable(member) or isinstance(member, (staticmethod, classmethod, property)):
                        held[f"{name}.{key}.{attr}"] = member
    return held


def _slipstreams(value) -> bool:
    """Whether ``value`` is slipstream's: a registered replacement, or a function (bound, or
    in a ``functools.partial``) defined in slipstream."""
    function = getattr(value, "func", value)
    function = getattr(function, "__func__", function)
    return (getattr(value, "__slipstream_patch__", None) is not None
            or str(getattr(function, "__module__", "")).startswith("slipstream"))


def _disable_after_overlap(rank, world):
    """A ZeRO-2 and a ZeRO-3 job with ``overlap`` (several buckets a step, reduced while
    backward goes on), their engines kept alive, then ``slipstream.disable()``: what changed
    in DeepSpeed before and after, and the patches ``status()`` listed while the jobs ran."""
    import importlib

    import deepspeed.comm as ds_comm

    import slipstream
    from slipstream.plugins.deepspeed.zero import overlaps

    for name in _PATCHED_DEEPSPEED:
        importlib.import_module(name)
    ds_comm.init_distributed(dist_backend="gloo")  # DeepSpeed's own backend object, made once
    slipstream.disable()  # the start-up hook may have installed the adapter when DeepSpeed was imported
    before = _deepspeed_functions()
    slipstream.enable()
    engines, listed = [], []
    for stage in (2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
        cfg = _ds_config(stage, 1, {"enabled": True, "comm": {**COMM, "overlap": True}})
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        assert overlaps(engine.optimizer), f"ZeRO-{stage}: the overlap did not engage"
        for x, y in _mlp_batches(rank, 2):
            engine.backward((engine(x) - y).pow(2).mean())
            engine.step()
        engines.append(engine)
        listed.append(slipstream.status()["patches"])
    slipstream.disable()
    after = _deepspeed_functions()
    changed = sorted(k for k in before if k not in after or after[k] is not before[k])
    ours = sorted(k for k, v in after.items() if _slipstreams(v))
    planted = {type(e.optimizer).__name__: sorted(k for k, v in vars(e.optimizer).items() if _slipstreams(v))
               for e in engines}
    return changed, ours, planted, listed


def test_disable_after_zero2_and_zero3_overlap_jobs_restores_every_deepspeed_function_and_attribute():
    for changed, ours, planted, listed in run_ranks(_disable_after_overlap, 2, rank_env=_env(0, 0), timeout=300):
        assert changed == [] and ours == [], (changed, ours)
        assert planted == {"DeepSpeedZeroOptimizer": [], "DeepSpeedZeroOptimizer_Stage3": []}, planted
        # while the jobs ran, status() listed the instance patches of each optimizer
        zero2, zero3 = listed
        assert "deepspeed-zero: DeepSpeedZeroOptimizer.reduce_ipg_grads" in zero2, zero2
        assert "deepspeed-zero: DeepSpeedZeroOptimizer.step" in zero2, zero2  # the gather behind the forward
        assert "deepspeed-zero: DeepSpeedZeroOptimizer_Stage3.independent_gradient_partition_epilogue" in zero3, zero3
        assert "deepspeed: deepspeed.comm.comm.cdb" in zero3 or any(".cdb" in p for p in zero3), zero3


def _llama_batches(rank, n, vocab):
    g = torch.Generator().manual_seed(7 + rank)
    for _ in range(n):
        lengths = torch.randint(1, 24, (4,), generator=g)
        ids = torch.randint(1, vocab, (4, 24), generator=g)
        mask = torch.arange(24)[None, :] < lengths[:, None]
        ids = ids.masked_fill(~mask, 0)
        labels = ids.masked_fill(~mask, -100)
        yield ids, mask.long(), labels


def _varlen_grad_accum(rank, world):
    import slipstream.deepspeed as sds
    from deepspeed.utils import safe_get_full_grad

    from slipstream.core_compile import is_varlen_patched
    from slipstream.plugins.deepspeed import uninstall
    from slipstream.recipes.model import build_model

    runs = {}
    for name, section in [("padded", None), ("varlen", {"comm": COMM, "varlen": {"enabled": True}})]:
        model = build_model("llama-tiny", vocab_size=128, seed=0)
        init = sds.initialize if section else deepspeed.initialize
        engine, *_ = init(model=model, model_parameters=model.parameters(), config=_ds_config(2, 2, section))
        assert is_varlen_patched(engine.module) == (name == "varlen")
        losses, grads = [], []
        for ids, mask, labels in _llama_batches(rank, 6, 128):
            loss = engine(input_ids=ids, attention_mask=mask, labels=labels).loss
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary():  # reduced, before the optimizer step
                grads.append([safe_get_full_grad(p).clone() for p in engine.module.parameters()])
            engine.step()
            losses.append(loss.item())
        runs[name] = (losses, grads, _full_weights(engine))
    uninstall()
    (v_loss, v_grads, v_w), (p_loss, p_grads, p_w) = runs["varlen"], runs["padded"]
    torch.testing.assert_close(torch.tensor(v_loss), torch.tensor(p_loss), rtol=1e-5, atol=0)
    assert_close_through_adam(v_w, p_w, v_grads, p_grads, lr=1e-2)
    return True


def test_varlen_section_with_grad_accumulation_equals_the_padded_run():
    run_ranks(_varlen_grad_accum, 2, rank_env=_env(0, 0), timeout=400)


@pytest.mark.parametrize(
    "section, message",
    [
        ({"enabled": True, "comms": {}}, "slipstream: unknown key 'comms'"),
        ({"comm": {"slot_bytes": 100}}, "slipstream.comm.slot_bytes: slot_bytes must be a positive multiple of 64"),
        ({"comm": {"shm": "yes"}}, "slipstream.comm.shm must be bool"),
        ({"comm": {"connections": 99}}, "connections must be between 1 and 16"),
        ({"varlen": {"enabled": True, "backend": "magic"}}, "slipstream.varlen: backend must be"),
        ({"varlen": {"enabled": True, "tiles": 3}}, "slipstream.varlen: unknown key 'tiles'"),
        ({"varlen": {"enabled": True, "compile": "yes"}}, "slipstream.varlen.compile must be bool"),
        ({"keep_freed_memory": 1}, "slipstream.keep_freed_memory must be bool"),
        ([1, 2], "slipstream must be an object"),
    ],
)
def test_config_section_errors_name_the_bad_key(section, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        SlipstreamConfig.from_dict(section)


def test_config_section_defaults_and_absence():
    assert not SlipstreamConfig.from_dict(None).enabled
    cfg = SlipstreamConfig.from_dict({"comm": {"chunk_bytes": 1 << 20}, "varlen": {"enabled": True}})
    assert cfg.enabled and cfg.comm.chunk_bytes == 1 << 20 and cfg.varlen is not None
    assert SlipstreamConfig.from_dict({"varlen": {"enabled": False, "backend": "sdpa"}}).varlen is None
    assert cfg.keep_freed_memory and not SlipstreamConfig.from_dict({"keep_freed_memory": False}).keep_freed_memory


def test_install_uninstall_round_trip_restores_deepspeed_initialize_and_the_build_lock():
    from torch.utils.file_baton import FileBaton

    from slipstream.plugins.deepspeed import install, uninstall

    uninstall()  # the start-up hook may have installed it when DeepSpeed was imported
    targets = [(deepspeed, "initialize"), (FileBaton, "try_acquire"), (FileBaton, "wait")]
    originals = [getattr(t, name) for t, name in targets]
    assert not any(hasattr(o, "__slipstream_patch__") for o in originals)
    install()
    hooked = [getattr(t, name) for t, name in targets]
    install()  # idempotent
    assert [getattr(t, name) for t, name in targets] == hooked
    assert all(h is not o and h.__wrapped__ is o for h, o in zip(hooked, originals))
    uninstall()
    assert all(getattr(t, name) is o for (t, name), o in zip(targets, originals))
    uninstall()  # idempotent
    assert all(getattr(t, name) is o for (t, name), o in zip(targets, originals))


def _checkpoint_interchange(rank, world, tmp):
    from slipstream.plugins.deepspeed import uninstall

    section = {"enabled": True, "comm": COMM}
    batches = list(_mlp_batches(rank, 4))

    def engine_for(use_slipstream):
        import slipstream.deepspeed as sds

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
        init = sds.initialize if use_slipstream else deepspeed.initialize
        cfg = _ds_config(2, 1, section if use_slipstream else None)
        return init(model=model, model_parameters=model.parameters(), config=cfg)[0]

    def step(engine, x, y):
        loss = (engine(x) - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        return loss.item()

    next_loss = {}
    for saver, loader in [(True, False), (False, True)]:
        first = engine_for(saver)
        for x, y in batches[:3]:
            step(first, x, y)
        tag = f"from_{'slipstream' if saver else 'stock'}"
        first.save_checkpoint(tmp, tag=tag)
        expected = step(first, *batches[3])
        second = engine_for(loader)
        second.load_checkpoint(tmp, tag=tag)
        next_loss[tag] = (expected, step(second, *batches[3]))
        uninstall()
    for expected, got in next_loss.values():
        assert abs(expected - got) <= 1e-6 * abs(expected)
    return True


def test_checkpoints_interchange_between_slipstream_and_stock(tmp_path):
    run_ranks(_checkpoint_interchange, 2, str(tmp_path), rank_env=_env(0, 0), timeout=400)


def test_tuned_bucket_sizes_fill_only_what_the_user_left_unset():
    from slipstream.plugins.deepspeed.engine import bucket_defaults

    user = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 123}, "train_batch_size": 8}
    rec = {"reduce_bucket_size": 999, "allgather_bucket_size": 456}
    out = bucket_defaults(user, rec)
    assert out["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 123, "allgather_bucket_size": 456}
    assert user["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 123}  # not mutated
    assert bucket_defaults(out, rec) is out  # nothing left to fill


@pytest.mark.parametrize("device,zero,overlap,expected", [
    # on a GPU DeepSpeed's own sizes: the cost model is the CPU path's
    ("cuda", {"stage": 2}, True, "none"),
    ("cuda", {"stage": 2, "overlap_comm": True}, True, "none"),
    ("cuda", {"stage": 3}, True, "none"),
    ("cuda", {"stage": 3, "overlap_comm": False}, True, "none"),
    ("cpu", {"stage": 3, "overlap_comm": True}, True, "ahead"),  # no streams; prefetch and gradients in buckets
    ("cpu", {"stage": 3}, False, "none"),  # no streams: every collective blocks
    ("cpu", {"stage": 2}, True, "gradients"),  # ZeRO-2's buckets reduced during backward (overlap.py)
    ("cpu", {"stage": 2}, False, "none"),
    ("cpu", {"stage": 1}, True, "none"),  # ZeRO-1 reduces after backward: no hook to overlap with
])
def test_tuned_buckets_only_where_a_cpu_overlaps_the_collectives(monkeypatch, device, zero, overlap, expected):
    from types import SimpleNamespace

    import deepspeed.accelerator

    from slipstream.core_comm.tuner import BucketSizes
    from slipstream.plugins.deepspeed import engine
    from slipstream.plugins.deepspeed.translate import zero_buckets

    accelerator = SimpleNamespace(device_name=lambda: device)
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: accelerator)
    backend = SimpleNamespace(communicator=lambda group: SimpleNamespace(plan=SimpleNamespace(buckets=BucketSizes())))
    ds_config = {"zero_optimization": zero}
    got = engine._recommended_buckets(backend, ds_config, overlap)
    every = zero_buckets(BucketSizes(), element_size=4)["zero_optimization"]
    assert got == {"gradients": {"reduce_bucket_size": every["reduce_bucket_size"]},
                   "ahead": {"stage3_prefetch_bucket_size": every["stage3_prefetch_bucket_size"],
                             "reduce_bucket_size": every["reduce_bucket_size"]}, "none": {}}[expected]


def _set_up_and_train(rank, world, section, dist_init_required):
    """Three steps of ZeRO-2 through plain ``deepspeed.initialize`` (the adapter installed, as
    by the start-up hook): the losses, or the name of the error the set-up raised."""
    from slipstream.plugins.deepspeed import install

    install()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=_ds_config(2, 1, section), dist_init_required=dist_init_required)
    except Exception as e:  # noqa: BLE001 - compared with stock's
        return {"error": type(e).__name__}
    losses = []
    for x, y in _mlp_batches(rank, 3):
        loss = (engine(x) - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses}


@pytest.mark.parametrize("group_made_first", [True, False], ids=["group-made-by-the-script", "no-group"])
@pytest.mark.parametrize("dist_init_required", [True, False, None])
def test_every_way_of_initialising_behaves_as_stock(group_made_first, dist_init_required):
    """Stock DeepSpeed adopts a group the script made, makes one when asked or when there is
    none, and refuses ``dist_init_required=False`` without a group: the adapter does the same."""
    runs = {}
    for impl, section in [("stock", None), ("slipstream", {"enabled": True, "comm": COMM})]:
        runs[impl] = run_ranks(_set_up_and_train, 2, section, dist_init_required, rank_env=_env(0, 0),
                               init_group=group_made_first, timeout=300)
    stock, ours = runs["stock"], runs["slipstream"]
    if "error" in stock[0]:
        assert ours == stock, f"stock raised {stock[0]['error']}; slipstream: {ours}"
        return
    assert all("losses" in r for r in ours), f"stock trained; slipstream: {ours}"
    for s, o in zip(stock, ours):
        torch.testing.assert_close(torch.tensor(o["losses"]), torch.tensor(s["losses"]), rtol=1e-5, atol=1e-6)


def _install_comm_settings(rank, world):
    import deepspeed.comm as ds_dist
    import deepspeed.comm.comm as ds_comm

    from slipstream.core_comm import CommConfig, pool
    from slipstream.plugins.deepspeed import install_comm, uninstall_comm

    deepspeed.init_distributed(dist_backend="gloo")
    original = ds_comm.cdb
    first = install_comm(CommConfig(**COMM))
    assert install_comm(CommConfig(**COMM)) is first  # the same settings: kept
    t = torch.ones(1000)
    ds_dist.all_reduce(t)
    assert pool.peek(None).config.chunk_bytes == COMM["chunk_bytes"]
    second = install_comm(CommConfig(**{**COMM, "chunk_bytes": 2 * COMM["chunk_bytes"]}))
    assert second is not first and second.__wrapped__ is original, "other settings must replace the stand-in"
    assert pool.peek(None) is None  # the old settings' communicator is closed
    ds_dist.all_reduce(t)
    assert pool.peek(None).config.chunk_bytes == 2 * COMM["chunk_bytes"]
    uninstall_comm()
    assert ds_comm.cdb is original and pool.peek(None) is None
    return t.tolist()


def test_install_comm_with_other_settings_replaces_the_stand_in():
    results = run_ranks(_install_comm_settings, 2, rank_env=_env(0, 0), timeout=300)
    assert results[0] == results[1] == [4.0] * 1000


def _compiled_run_length(rank, world):
    """ZeRO-2 with ``"compile"`` in the section and a scheduler of 3 steps of 2 micro-batches:
    the search's run length and what it chose."""
    import slipstream
    import slipstream.deepspeed as sds

    torch.manual_seed(0)  # layers of one class: regions to compile
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    cfg = _ds_config(2, 2, {"enabled": True, "comm": COMM,
                            "compile": {"enabled": True, "cache": False, "verbose": False, "background": False}})
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"total_num_steps": 3, "warmup_num_steps": 1}}
    engine, *_ = sds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for x, y in _mlp_batches(rank, 6):
        loss = (engine(x) - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
    report = slipstream.compile_report(engine.module)
    return {"expected_steps": report.expected_steps, "decided_at_step": report.decided_at_step,
            "chosen": report.chosen, "skipped": {c.name: c.reason for c in report.candidates if c.status == "skipped"}}


def test_the_search_counts_the_schedulers_steps_times_the_accumulation():
    """The engine's module is called once per micro-batch: 3 scheduler steps of 2 micro-batches
    are 6 forward calls, whose 5% pays for no compile, so the search ends at step 4."""
    for report in run_ranks(_compiled_run_length, 2, rank_env=_env(0, 0), timeout=300):
        assert report["expected_steps"] == 6 and report["decided_at_step"] == 4, report
        assert report["chosen"] == "eager" and report["skipped"], report
        assert all("expected compile" in why or "did not change" in why for why in report["skipped"].values()), report
