"""The FSDP2 adapter against stock FSDP2 on the same gloo group: same losses and parameters,
the fast path taken, and ``remove`` restoring the stock comms."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _adam import assert_close_through_adam
from _dist import from_bytes as _load, run_ranks, to_bytes as _bytes
from slipstream.plugins.fsdp.overlap import param_groups

pytest.importorskip("torch.distributed.fsdp")


class Tiny(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32)
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.Linear(96, 63),
                                        torch.nn.GELU(), torch.nn.Linear(63, 32))
        self.head = torch.nn.Linear(32, 50, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.body(self.emb(ids))).float()


def _model(dtype=torch.float32, tied=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Tiny(tied)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in (model.body[0], model.body[2], model.body[4]):  # 63: uneven shards
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def _forward(model, ids):
    return model(ids)


def _train(rank, ours, *, steps=3, accum=1, dtype=torch.float32, tied=False):
    from slipstream import fsdp
    from slipstream.core_comm import counters

    model = _model(dtype, tied)
    if ours:
        fsdp.apply(model)
        fsdp.apply(model)  # idempotent
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    counters.reset()
    losses, grads = [], []
    for _ in range(steps):
        for micro in range(accum):
            model.set_requires_gradient_sync(micro == accum - 1)  # accumulate unsharded grads, sync at the last
            ids = torch.randint(0, 50, (6, 5), generator=gen)
            loss = torch.nn.functional.cross_entropy(_forward(model, ids).flatten(0, 1), ids.roll(1, 1).flatten())
            loss.backward()
            losses.append(loss.item())
        grads.append([p.grad.full_tensor().float() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    counts = counters.snapshot()
    weights = [p.full_tensor().detach().float() for p in model.parameters()]
    if ours:
        fsdp.remove(model)
        assert not fsdp.is_applied(model)
        counters.reset()
        loss = torch.nn.functional.cross_entropy(_forward(model, ids).flatten(0, 1), ids.roll(1, 1).flatten())
        loss.backward()
        assert "reduce_scatter" not in counters.snapshot(), "removed: FSDP's own comms again"
    return {"losses": losses, "weights": weights, "grads": grads, "counts": counts}


def _both(rank, world, kwargs):
    return _bytes({"stock": _train(rank, False, **kwargs), "ours": _train(rank, True, **kwargs)})


@pytest.mark.parametrize("kwargs", [{}, {"accum": 2}, {"dtype": torch.bfloat16}, {"tied": True}],
                         ids=["fp32", "accumulation", "bf16-params-fp32-reduce", "tied-embeddings"])
def test_fsdp2_through_the_core_matches_stock_fsdp2(kwargs):
    for r in _load(run_ranks(_both, 2, kwargs, rank_env=[{"SLIPSTREAM_NODE": "0"}] * 2, timeout=240)):
        s, o = r["stock"], r["ours"]
        torch.testing.assert_close(o["losses"], s["losses"], rtol=1e-5, atol=0)
        assert_close_through_adam(o["weights"], s["weights"], o["grads"], s["grads"], lr=1e-3)
        counts = o["counts"]
        assert counts["reduce_scatter"].keys() <= {"shm", "cma"}, counts
        assert counts["all_gather"].keys() <= {"shm", "cma"}, counts
        assert counts["reduce_scatter"][next(iter(counts["reduce_scatter"]))]["calls"] >= 3


def test_fsdp2_on_two_emulated_nodes_goes_hierarchical_and_matches_stock():
    nodes = [{"SLIPSTREAM_NODE": str(n)} for n in (0, 0, 1, 1)]
    for r in _load(run_ranks(_both, 4, {"steps": 2}, rank_env=nodes, timeout=300)):
        s, o = r["stock"], r["ours"]
        torch.testing.assert_close(o["losses"], s["losses"], rtol=1e-5, atol=0)
        assert_close_through_adam(o["weights"], s["weights"], o["grads"], s["grads"], lr=1e-3)
        assert set(o["counts"]["reduce_scatter"]) == {"hierarchical"}, o["counts"]
        assert set(o["counts"]["all_gather"]) == {"hierarchical"}, o["counts"]


def _module_without_fsdp(rank, world):
    from slipstream import fsdp

    with pytest.raises(ValueError, match="no FSDP2 module"):
        fsdp.apply(torch.nn.Linear(2, 2))
    return True


def test_apply_to_a_model_without_fully_shard_says_so():
    assert run_ranks(_module_without_fsdp, 2, timeout=60) == [True, True]


def test_param_groups_reads_either_torch_spelling_of_an_fsdp2_state():
    """torch 2.13 keeps a list of parameter groups, torch 2.11 one group or None (found on a
    GPU machine's torch 2.11, where ``apply`` raised AttributeError)."""
    from types import SimpleNamespace

    one, two = object(), object()
    assert param_groups(SimpleNamespace(_fsdp_param_groups=[one, two])) == [one, two]
    assert param_groups(SimpleNamespace(_fsdp_param_groups=[])) == []
    assert param_groups(SimpleNamespace(_fsdp_param_group=one)) == [one]
    assert param_groups(SimpleNamespace(_fsdp_param_group=None)) == []


@pytest.mark.slow
def test_accelerate_with_an_fsdp_plugin_runs_fsdp2_through_the_core_with_ddps_losses(tmp_path):
    """On CPU stock accelerate runs DDP although FSDP is configured; with slipstream it runs
    FSDP2 (as configured) through the core. The numbers are DDP's: same losses, same weights."""
    import json
    import os
    import re
    import subprocess
    import sys

    from _dist import free_port

    pytest.importorskip("accelerate")
    script = os.path.join(os.path.dirname(__file__), "_accelerate_fsdp.py")

    def run(ours: bool) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM")}
        env.update(OURS=str(int(ours)), OMP_NUM_THREADS="1", FSDP_VERSION="2")
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--log-dir", str(tmp_path / "logs"),
                              "--nproc-per-node", "2", "--master-port", str(free_port()), script],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
        assert out.returncode == 0, out.stderr[-4000:]
        fields = dict(re.findall(r"^(type|losses|state|status) (.*)$", out.stdout, re.M))
        return {"out": out, **fields}

    stock, ours = run(False), run(True)
    assert stock["type"].startswith("DistributedDataParallel")
    assert "FSDP" in ours["type"].split()[0] and "FSDP" in ours["type"].split()[1]
    assert json.loads(ours["losses"]) == pytest.approx(json.loads(stock["losses"]), rel=1e-6)
    assert float(ours["state"].rsplit(" ", 1)[1]) == pytest.approx(float(stock["state"].rsplit(" ", 1)[1]), rel=1e-5)
    assert "'reduce_scatter': {'shm'" in ours["status"] and "'all_gather': {'shm'" in ours["status"]
    assert "runs FSDP (version 2) as configured" in ours["out"].stderr


def test_the_accelerate_patches_install_and_uninstall_exactly():
    pytest.importorskip("accelerate")
    import accelerate.accelerator as acc
    import accelerate.state as state

    from slipstream.plugins.accelerate import adapter

    def now():
        return (acc.fsdp2_prepare_model, state.AcceleratorState.__dict__["__init__"],
                acc.Accelerator.__dict__["prepare_model"])

    before = now()
    adapter.install()
    adapter.install()  # idempotent
    assert all(new.__wrapped__ is old for new, old in zip(now(), before))
    adapter.uninstall()
    assert now() == before


def _sgd_steps(model, rank, steps=3) -> list:
    """``steps`` SGD steps on this rank's batches, counters reset first; the losses."""
    from slipstream.core_comm import counters

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    counters.reset()
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 50, (6, 5), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(1, 1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _hsdp(rank, world, ours):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from slipstream import fsdp
    from slipstream.core_comm import counters

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # shard inside a node
    torch.manual_seed(0)
    model = Tiny(False)
    for layer in (model.body[0], model.body[2], model.body[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if ours:
        fsdp.apply(model)
    losses = _sgd_steps(model, rank)
    counts = counters.snapshot()
    weights = [p.full_tensor().detach() for p in model.parameters()]
    if ours:  # the user can tell what slipstream did
        import slipstream
        from slipstream._status import line as status_line

        st = slipstream.status()
        assert st["enabled_by"] == "slipstream.fsdp.apply", st
        assert st["stacks"]["fsdp"]["modules_through_the_core"] == 4, st
        assert "hsdp_replicate_all_reduce through the core" in status_line(st), st
        fsdp.remove(model)
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives

        assert _fsdp_collectives.dist is dist, "the HSDP all-reduce view was not removed"
    return _bytes({"losses": losses, "weights": weights, "counts": counts})


def test_hsdp_reduce_scatter_inside_nodes_and_all_reduce_across_them_through_the_core():
    nodes = [{"SLIPSTREAM_NODE": str(n)} for n in (0, 0, 1, 1)]
    stock = _load(run_ranks(_hsdp, 4, False, rank_env=nodes, timeout=300))
    ours = _load(run_ranks(_hsdp, 4, True, rank_env=nodes, timeout=300))
    for s, o in zip(stock, ours):
        torch.testing.assert_close(o["losses"], s["losses"], rtol=1e-5, atol=0)
        for a, b in zip(o["weights"], s["weights"]):  # SGD: weight differences = lr x gradient rounding
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        counts = o["counts"]
        assert set(counts["reduce_scatter"]) <= {"shm", "cma"}, counts  # the shard group is one node
        assert "all_reduce" in counts and "stock" not in counts["all_reduce"], counts  # across the nodes


def _fsdp1(rank, world, ours):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from slipstream.core_comm import counters
    from slipstream.plugins.fsdp.fsdp1 import register

    torch.manual_seed(0)
    model = FSDP(Tiny(False), device_id=torch.device("cpu"), use_orig_params=True)
    if ours:
        register(model)
    losses = _sgd_steps(model, rank)
    with FSDP.summon_full_params(model):
        weights = [p.detach().clone() for p in model.parameters()]
    return _bytes({"losses": losses, "weights": weights, "counts": counters.snapshot()})


def test_fsdp1_comm_hook_matches_stock_fsdp1():
    env = [{"SLIPSTREAM_NODE": "0"}] * 2
    stock = _load(run_ranks(_fsdp1, 2, False, rank_env=env, timeout=300))
    ours = _load(run_ranks(_fsdp1, 2, True, rank_env=env, timeout=300))
    for s, o in zip(stock, ours):
        torch.testing.assert_close(o["losses"], s["losses"], rtol=1e-5, atol=0)
        for a, b in zip(o["weights"], s["weights"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert set(o["counts"]["reduce_scatter"]) <= {"shm", "cma"}, o["counts"]


def _checkpoint_interchange(rank, world, tmp, ours_saves):
    """A distributed checkpoint saved by one side loads in the other with the same next loss."""
    import torch.distributed.checkpoint as dcp

    from slipstream import fsdp

    def model_and_opt(ours):
        model = _model()
        if ours:
            fsdp.apply(model)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(model, opt, seed):
        ids = torch.randint(0, 50, (6, 5), generator=torch.Generator().manual_seed(seed + rank))
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(1, 1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    saver, opt = model_and_opt(ours_saves)
    for seed in range(2):
        step(saver, opt, seed)
    dcp.save({"model": saver.state_dict(), "opt": opt.state_dict()}, checkpoint_id=tmp)
    after_saver = step(saver, opt, 7)
    loader, opt2 = model_and_opt(not ours_saves)
    step(loader, opt2, 99)  # so that the optimizer has state to load into
    state = {"model": loader.state_dict(), "opt": opt2.state_dict()}
    dcp.load(state, checkpoint_id=tmp)
    loader.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    return after_saver, step(loader, opt2, 7)


@pytest.mark.parametrize("ours_saves", [True, False], ids=["slipstream-saves", "stock-saves"])
def test_distributed_checkpoints_interchange_with_stock_fsdp2(tmp_path, ours_saves):
    env = [{"SLIPSTREAM_NODE": "0"}] * 2
    for saved, loaded in run_ranks(_checkpoint_interchange, 2, str(tmp_path / "ckpt"), ours_saves, rank_env=env,
                                   timeout=300):
        assert loaded == pytest.approx(saved, rel=1e-6)


def _overlap_against_blocking(rank, world, hsdp):
    """FSDP2 (or HSDP) trained twice through the core, the reductions blocking and issued
    during backward (``overlap``): bit-equal losses, gradients and weights; the core's timeline
    says which collectives ran while this rank computed (hidden) and which it waited for. A third
    run issues only the reductions during backward (FSDP2's prefetched all-gathers blocking), so
    its hidden time is theirs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from slipstream import fsdp
    from slipstream.core_comm import counters
    from slipstream.core_comm.config import CommConfig

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    stock_reduce = _fsdp_param_group.foreach_reduce
    runs = {}
    for overlap in (False, True, "reductions only"):
        torch.manual_seed(0)
        model = Tiny(False)
        for layer in (model.body[0], model.body[2], model.body[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        fsdp.apply(model, CommConfig(overlap=bool(overlap)))
        if overlap == "reductions only":
            for module in model.modules():
                if hasattr(module, "_get_fsdp_state"):
                    for group in param_groups(module._get_fsdp_state()):
                        group.unshard_async_op = False
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        counters.timeline.take()
        losses, grads = [], []
        for _ in range(3):
            ids = torch.randint(0, 50, (6, 5), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(1, 1).flatten())
            loss.backward()
            grads += [p.grad.to_local().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        timeline = counters.timeline.take()
        weights = [p.to_local().detach().clone() for p in model.parameters()]
        fsdp.remove(model)
        assert _fsdp_param_group.foreach_reduce is stock_reduce, "remove left FSDP2's foreach_reduce patched"
        runs[overlap] = losses, grads + weights, timeline
    blocking = runs[False]
    for overlapped in (runs[True], runs["reductions only"]):
        assert blocking[0] == overlapped[0], "losses differ from the blocking path's"
        for a, b in zip(blocking[1], overlapped[1], strict=True):
            assert torch.equal(a, b), "gradients or weights differ from the blocking path's"
    return blocking[2], runs[True][2], runs["reductions only"][2]


@pytest.mark.parametrize("nodes, hsdp", [((0, 0), False), ((0, 0, 1, 1), False), ((0, 0, 1, 1), True)],
                         ids=["fsdp2-1node", "fsdp2-2nodes", "hsdp-2nodes"])
def test_fsdp2_reductions_run_while_backward_computes_bit_equal_to_blocking(nodes, hsdp):
    env = [{"SLIPSTREAM_NODE": str(n)} for n in nodes]
    for blocking, overlapped, reductions in run_ranks(_overlap_against_blocking, len(nodes), hsdp, rank_env=env,
                                                      timeout=300):
        assert blocking["hidden_s"] == 0.0 and blocking["exposed_s"] > 0, blocking  # every collective held the rank
        # a reduction in flight while backward went on (the core's own timestamps)
        assert reductions["hidden_s"] > 0, reductions
        assert overlapped["hidden_s"] > 0, overlapped


def _auto_overlap(rank, world):
    """FSDP2 with the default ``"overlap": "auto"`` on a slow link (each reduce-scatter as long
    as a layer's backward) and with ``"overlap": false``, 2 micro-batches a step (the first
    accumulated unreduced): what the trial chose, whether it was still running after each
    step, the losses and the weights of each."""
    from torch.distributed.fsdp import fully_shard

    import slipstream
    from _overlap_trial import Layers, batch, slow_link
    from slipstream import fsdp
    from slipstream.core_comm.config import CommConfig
    from slipstream.core_comm.tuner import overlap as ot

    runs = {}
    for overlap in ("auto", False):
        torch.manual_seed(0)
        wait_s = 0.08 if overlap == "auto" else 0.0  # blocking is the numbers' reference: nothing timed
        model = Layers(compute_s=wait_s)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        fsdp.apply(model, CommConfig(overlap=overlap))
        # where overlap engages, each layer prefetches the next one's parameters in forward
        prefetch = [[id(s) for s in layer._get_fsdp_state()._states_to_forward_prefetch] for layer in model.layers]
        chained = [[id(layer._get_fsdp_state())] for layer in model.layers[1:]] + [[]]
        assert prefetch == (chained if overlap == "auto" else [[]] * len(model.layers)), prefetch
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, in_trial = [], []
        with slow_link(wait_s):
            for step in range(ot.WARMUP + 2 * ot.ROUNDS + 1):
                for micro in range(2):
                    model.set_requires_gradient_sync(micro == 1)
                    x, y = batch(rank, 2 * step + micro)
                    loss = (model(x) - y).pow(2).mean()
                    loss.backward()
                    losses.append(loss.item())
                opt.step()
                opt.zero_grad()
                facts = slipstream.status()["stacks"]["fsdp"]
                in_trial.append(facts["reductions_during_backward"] == "auto (in trial)")
        runs[overlap] = losses, [p.to_local().detach().clone() for p in model.parameters()], facts, in_trial
        fsdp.remove(model)
        assert not any(layer._get_fsdp_state()._states_to_forward_prefetch for layer in model.layers)  # put back
    (auto, auto_w, facts, in_trial), (blocking, blocking_w, _, _) = runs["auto"], runs[False]
    assert auto == blocking and all(torch.equal(a, b) for a, b in zip(auto_w, blocking_w))
    return {**facts, "in_trial": in_trial}


@pytest.mark.slow
def test_fsdp2_overlap_auto_overlaps_on_a_slow_link_bit_equal_to_blocking(tmp_path):
    from slipstream.core_comm.tuner import overlap as ot

    for facts in run_ranks(_auto_overlap, 2, env={"SLIPSTREAM_OVERLAP_DIR": str(tmp_path)}, timeout=300):
        assert facts["reductions_during_backward"] is True, facts
        assert "FSDP2 reductions overlapped (measured" in facts["overlap"], facts
        # the trial counts optimizer steps, not backwards: decided at the end of its last step
        decided = ot.WARMUP + 2 * ot.ROUNDS
        assert facts["in_trial"] == [True] * (decided - 1) + [False] * 2, facts
