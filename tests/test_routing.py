"""The core's one routing rule and pool, through the ``slipstream`` backend against gloo on the
same ranks: AVG, PREMUL_SUM, MAX/MIN with NaN, the coalesced forms torch's coalescing manager
issues, per-path counters that prove the fast path was taken, the profiler range, and one
group's destruction leaving the others working."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.testing import assert_close

import slipstream  # noqa: F401 - registers the backend in the ranks that unpickle this module
from _dist import from_bytes as _load
from _dist import int_values as _values
from _dist import all_gather_single, reduce_scatter_single, run_ranks
from _dist import to_bytes as _bytes
from slipstream.core_comm import counters, pool

ReduceOp = dist.ReduceOp
FAST = {"shm", "cma", "hierarchical"}


def _with_nans(rank: int, numel: int) -> torch.Tensor:
    t = _values(rank, numel, seed=2)
    t[rank] = float("nan")  # every rank's NaN at its own index, and rank 1's at 100 too
    t[100] = float("nan") if rank == 1 else t[100]
    return t


def _premul(factor: float):
    """PREMUL_SUM(factor), a NCCL op gloo refuses: on gloo the reference scales, then sums."""
    if dist.get_backend() == "gloo":
        return None
    return dist._make_nccl_premul_sum(factor)


def _ops_and_coalesced(rank: int, world: int) -> bytes:
    counters.reset()
    out: dict = {}
    for name, numel in [("small", 1000), ("large", 300_000)]:
        t = _values(rank, numel, seed=numel)
        dist.all_reduce(t, op=ReduceOp.AVG)
        out[f"avg_{name}"] = t
        t = _values(rank, numel, seed=numel + 1)
        op = _premul(0.25)
        dist.all_reduce(t.mul_(0.25) if op is None else t, op=op or ReduceOp.SUM)
        out[f"premul_{name}"] = t
    for op in (ReduceOp.MAX, ReduceOp.MIN):
        for numel in (5000, 300_000):
            t = _with_nans(rank, numel)
            dist.all_reduce(t, op=op)
            out[f"_nan_{op}_{numel}"] = t  # compared with torch's semantics, not gloo's
    n = 20_000
    o = torch.empty(n)
    inp = _values(rank, world * n, seed=3)
    kept = inp.clone()
    reduce_scatter_single(o, inp, op=ReduceOp.AVG)
    out["reduce_scatter_avg"] = o
    o = torch.empty(n)
    op = _premul(0.5)
    reduce_scatter_single(o, inp * 0.5 if op is None else inp, op=op or ReduceOp.SUM)
    out["reduce_scatter_premul"] = o
    out["premul_input_untouched"] = torch.equal(inp, kept)
    # the coalescing manager: what FSDP and Megatron's DDP issue
    ts = [_values(rank, k, seed=10 + k) for k in (300, 70_000, 5)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t, op=ReduceOp.AVG)
    cm.wait()
    out["coalesced_all_reduce"] = ts
    outs, ins = [torch.empty(k) for k in (64, 4000)], [_values(rank, world * k, seed=k) for k in (64, 4000)]
    with dist._coalescing_manager():
        for o, i in zip(outs, ins):
            reduce_scatter_single(o, i, op=ReduceOp.SUM)
    out["coalesced_reduce_scatter"] = outs
    outs, ins = [torch.empty(world * k) for k in (64, 4000)], [_values(rank, k, seed=k + 1) for k in (64, 4000)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            all_gather_single(o, i)
    cm.wait()
    out["coalesced_all_gather"] = outs
    out["_counts"] = counters.snapshot()
    return _bytes(out)


def test_avg_premul_nan_and_coalesced_calls_match_gloo_on_the_fast_path():
    stock = _load(run_ranks(_ops_and_coalesced, 3, timeout=240))
    ours = _load(run_ranks(_ops_and_coalesced, 3, backend="slipstream", timeout=240))
    for rank, (s, o) in enumerate(zip(stock, ours)):
        counts = o.pop("_counts")
        s.pop("_counts")
        nans = {k: o.pop(k) for k in list(o) if k.startswith("_nan")}
        assert s.keys() - nans.keys() == o.keys()
        for key in o:
            assert_close(o[key], s[key], equal_nan=True, rtol=1e-6, atol=1e-6, msg=lambda m: f"rank {rank} {key}: {m}")
        assert o["premul_input_untouched"] is True
        for kind in ("all_reduce", "reduce_scatter", "all_reduce_coalesced", "reduce_scatter_coalesced",
                     "all_gather_coalesced"):
            paths = counts.get(kind, {})
            assert set(paths) <= FAST and paths, f"rank {rank}: {kind} took {paths}"
        assert counts["all_reduce_coalesced"]["shm"]["calls"] == 1  # one operation, not three
        # MAX/MIN: NaN wherever any rank has one (torch.maximum's semantics). gloo's own result
        # depends on the ring's order (a NaN survives only where it is the accumulator), so
        # every NaN gloo returns must be one of ours, and everything else equal.
        for key, got in nans.items():
            numel = got.numel()
            rows = torch.stack([_with_nans(r, numel) for r in range(3)])
            want = rows.amax(0) if "MAX" in key else rows.amin(0)
            assert_close(got, want, equal_nan=True, rtol=0, atol=0, msg=lambda m: f"rank {rank} {key}: {m}")
            assert torch.isnan(got[torch.isnan(s[key])]).all()


def _pool_and_destroy(rank: int, world: int) -> bytes:
    a, b = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    t = _values(rank, 100_000)
    dist.all_reduce(t, group=a)
    dist.all_reduce(t, group=b)
    comm_b = pool.peek(b)
    assert pool.peek(a) is not None and comm_b is not None and comm_b is not pool.peek(a)
    dist.destroy_process_group(a)
    assert pool.peek(a) is None and pool.peek(b) is comm_b, "destroying one group closed another's communicator"
    dist.all_reduce(t, group=b)  # still works, same communicator
    dist.all_reduce(t)  # and the default group
    assert pool.peek(b) is comm_b
    with torch.profiler.profile() as prof:
        dist.all_reduce(t, group=b)
    names = {e.name for e in prof.events()}
    return _bytes({"t": t, "profiled": sorted(n for n in names if n.startswith("slipstream:"))})


def test_destroying_one_group_leaves_the_others_and_the_profiler_names_the_path():
    ours = _load(run_ranks(_pool_and_destroy, 2, backend="slipstream", timeout=240))
    expected = 16 * (_values(0, 100_000) + _values(1, 100_000))  # four all-reduces, exact integers
    for o in ours:
        assert_close(o["t"], expected, rtol=0, atol=0)
        assert o["profiled"] in (["slipstream:all_reduce:shm"], ["slipstream:all_reduce:cma"])


def _fsdp2(rank: int, world: int) -> bytes:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 63))
    for layer in (model[0], model[2]):  # 63 outputs: uneven shards over 2 ranks
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)  # weight differences = lr x gradient differences
    counters.reset()
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(8, 64, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = [p.full_tensor().detach() for p in model.parameters()]
    return _bytes({"losses": losses, "weights": weights, "counts": counters.snapshot()})


def test_fsdp2_reduce_scatter_avg_and_all_gather_take_the_fast_path_with_gloos_weights():
    stock = _load(run_ranks(_fsdp2, 2, timeout=240))
    ours = _load(run_ranks(_fsdp2, 2, backend="slipstream", timeout=240))
    for rank, (s, o) in enumerate(zip(stock, ours)):
        assert_close(o["losses"], s["losses"], rtol=1e-6, atol=0)
        for a, b in zip(o["weights"], s["weights"]):
            assert_close(a, b, rtol=1e-5, atol=1e-7)
        counts = o["counts"]
        # FSDP2 reduce-scatters gradients with AVG and gathers parameters: both on the fast path
        # (full_tensor() gathers through DTensor's coalesced all-gather)
        assert {"all_gather", "reduce_scatter"} <= set(counts) and all(set(p) <= FAST for p in counts.values()), counts
        assert counts["reduce_scatter"]["shm"]["calls"] == 2 * 3  # two modules hold parameters, three steps


def test_hashed_group_names_follow_torch():
    from torch.distributed import distributed_c10d as c10d

    from slipstream.core_comm.groups import _hashed_name

    ranks = [0, 2, 5]
    assert _hashed_name(ranks, len(c10d._world.pg_names)) == c10d._hash_ranks_to_str(ranks)


def _requires_grad(rank: int, world: int) -> bytes:
    t = _values(rank, 300_000).requires_grad_()
    dist.all_reduce(t)  # gloo reduces the values of a tensor that requires grad; so must we
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    return _bytes(t.detach())


def test_a_tensor_that_requires_grad_is_reduced_like_gloo():
    stock = _load(run_ranks(_requires_grad, 2, timeout=120))
    ours = _load(run_ranks(_requires_grad, 2, backend="slipstream", timeout=120))
    for s, o in zip(stock, ours):
        assert_close(o, s, rtol=0, atol=0)


def _peer_never_arrives(rank: int, world: int) -> str:
    import time

    if rank == 1:
        return "left"  # exits without the collective its peer makes
    start = time.monotonic()
    try:
        dist.all_reduce(_values(rank, 300_000))
    except Exception as e:  # noqa: BLE001 - the failure is the result
        return f"{time.monotonic() - start:.1f} {e}"
    return "no error"


def test_a_peer_that_never_arrives_fails_within_the_timeout_not_gloos_30_minutes():
    results = run_ranks(_peer_never_arrives, 2, backend="slipstream", env={"SLIPSTREAM_TIMEOUT_S": "3"},
                        pg_timeout=600, timeout=120, allow_failures=True)
    seconds, message = results[0].split(" ", 1)
    assert float(seconds) < 3 * 1.2 + 2, results[0]
    assert "ranks [0, 1]" in message and "did not arrive" in message, message


def _async_error(rank: int, world: int) -> bytes:
    t = _values(rank, 300_000)
    bad = dist._make_nccl_premul_sum(torch.tensor(2 + 1j))  # a factor that cannot scale a float tensor
    work = dist.all_reduce(t, op=bad, async_op=True)
    errors = []
    for check in (work.wait, lambda: work.get_future().value(), lambda: work.get_future().wait()):
        try:
            check()
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - the failure is the result
            errors.append(str(e))
    t = _values(rank, 300_000)
    dist.all_reduce(t)  # the group still works: the error was this call's alone
    return _bytes({"errors": errors, "t": t})


def test_an_async_error_reaches_torch_as_an_error_and_the_group_goes_on():
    ours = _load(run_ranks(_async_error, 2, backend="slipstream", timeout=120))
    for o in ours:
        assert all(e is not None and "ComplexFloat" in e for e in o["errors"]), o["errors"]
        assert_close(o["t"], _values(0, 300_000) + _values(1, 300_000), rtol=0, atol=0)



# ---------------------------------------------------------------- the rule itself, no group


class _Plan:
    """A plan that answers one choice for every call."""

    def __init__(self, choice):
        self.choice, self.source = choice, "test"

    def choose(self, kind, nbytes, dtype):
        return self.choice


def _route(kind="all_reduce", tensor=None, op=ReduceOp.SUM, plan=None, one_per_node=False, **config):
    from slipstream.core_comm import CommConfig
    from slipstream.core_comm.routing import route

    tensor = torch.ones(1000) if tensor is None else tensor
    return route(kind, tensor, op, world=4, config=CommConfig(**config), backend="gloo", plan=plan,
                 hierarchical=True, intra=not one_per_node, unavailable="", one_per_node=one_per_node)[0]


def test_the_rule_refuses_what_no_fast_path_computes_before_any_communicator():
    from slipstream.core_comm import CommConfig
    from slipstream.core_comm.routing import refusal

    config = CommConfig()
    assert refusal(torch.ones(4), config=config, backend="gloo") is None
    assert "dtype" in refusal(torch.ones(4, dtype=torch.complex64), config=config, backend="gloo")
    assert "AVG" in refusal(torch.ones(4, dtype=torch.int32), ReduceOp.AVG, config=config, backend="gloo")
    assert "disabled" in refusal(torch.ones(4), config=CommConfig(shm=False), backend="gloo")
    assert "layout" in refusal(torch.ones(4).to_sparse(), config=config, backend="gloo")


def test_a_size_sends_a_call_to_stock_only_where_stock_computes_the_same_numbers():
    from slipstream.core_comm.routing import Choice

    stock = _Plan(Choice("stock"))
    assert _route(plan=stock) == "stock"  # a float32 SUM: gloo's sum
    assert _route("all_gather", plan=stock) == "stock"  # no arithmetic
    for op in (ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN, dist._make_nccl_premul_sum(0.5)):
        assert _route(plan=stock, op=op) == "hierarchical", op  # gloo refuses or differs
    assert _route(plan=stock, tensor=torch.ones(1000, dtype=torch.bfloat16)) == "hierarchical"  # fp32 accumulation
    assert _route(min_hierarchical_bytes=1 << 20) == "stock"
    assert _route(min_hierarchical_bytes=1 << 20, op=ReduceOp.MAX) == "hierarchical"
    assert _route(plan=_Plan(Choice("hierarchical", 1 << 20)), min_hierarchical_bytes=1 << 20) == "hierarchical"


def test_with_one_rank_per_node_small_calls_take_the_stock_exchange_where_it_gives_the_same():
    """No stage inside a node: below the measured sizes (of the whole buffer) the stock
    collective; from them, a plan's choice, a lossy wire or a non-SUM op, the hierarchical path."""
    from slipstream.core_comm.routing import ONE_PER_NODE_STOCK_BELOW_BYTES as BELOW, Choice

    def buf(nbytes, dtype=torch.float32):
        return torch.ones(nbytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype)

    for kind in ("all_reduce", "reduce_scatter"):
        assert _route(kind, buf(BELOW[kind] - 4), one_per_node=True) == "stock", kind
        assert _route(kind, buf(BELOW[kind]), one_per_node=True) == "hierarchical", kind
        assert _route(kind, buf(BELOW[kind] - 4)) == "hierarchical", kind  # 2 ranks a node: the rule is theirs
    # the allgather's input is one rank's part (world 4): the whole output counts
    assert _route("all_gather", buf(BELOW["all_gather"] // 4 - 4), one_per_node=True) == "stock"
    assert _route("all_gather", buf(BELOW["all_gather"] // 4), one_per_node=True) == "hierarchical"
    small = buf(64 << 10)
    assert _route(tensor=small, op=ReduceOp.AVG, one_per_node=True) == "hierarchical"  # gloo has no AVG
    assert _route(tensor=buf(64 << 10, torch.bfloat16), one_per_node=True) == "hierarchical"  # fp32 sums
    assert _route(tensor=small, plan=_Plan(Choice("hierarchical")), one_per_node=True) == "hierarchical"
    lossy = buf(BELOW["all_reduce"] // 2)  # at least wire_min_bytes: int8 makes it smaller
    assert _route(tensor=lossy, one_per_node=True, wire="int8") == "hierarchical"
    assert _route(tensor=lossy, one_per_node=True) == "stock"
