"""The ``slipstream`` backend through torch.distributed's public API, against gloo on the same
ranks: the same program runs under ``init_process_group("gloo")`` and
``init_process_group("slipstream")`` and every result must match (exactly for integer-valued
data; fp32 tolerance where the core sums in another order)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

import slipstream  # noqa: F401 - registers the backend in the ranks that unpickle this module
from _dist import from_bytes as _load
from _dist import int_values as _values
from _dist import all_gather_single, run_ranks, spellings as _spellings, reduce_scatter_single
from _dist import to_bytes as _bytes
from slipstream.core_comm.backend.process_group import SlipstreamProcessGroup

TWO_NODES = [{"SLIPSTREAM_NODE": str(r // 2)} for r in range(4)]


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares the failure itself
        return type(e).__name__
    return None


def _collectives(rank: int, world: int) -> dict:
    """Every public collective once; returns what each produced (CPU tensors, objects)."""
    out: dict = {}
    # allreduce: small (latency path), large (several 1 MiB slots), ops, dtypes, strides
    for name, numel, dtype, op in [("small", 1000, torch.float32, dist.ReduceOp.SUM),
                                   ("large", 600_000, torch.float32, dist.ReduceOp.SUM),
                                   ("max", 70_000, torch.int64, dist.ReduceOp.MAX),
                                   ("bf16", 50_000, torch.bfloat16, dist.ReduceOp.SUM),
                                   ("int8", 1000, torch.int8, dist.ReduceOp.SUM)]:
        t = _values(rank, numel, dtype, seed=numel)
        dist.all_reduce(t, op=op)
        out[f"all_reduce_{name}"] = t
    strided = _values(rank, 2000).view(1000, 2)[:, 0]
    dist.all_reduce(strided)
    # gloo 2.13 sums a strided tensor wrongly; compared with the reference, not with gloo
    out["_all_reduce_strided"] = strided
    out["all_reduce_avg_error"] = _error(lambda: dist.all_reduce(torch.ones(8), op=dist.ReduceOp.AVG))
    # async handles
    t = _values(rank, 300_000, seed=3)
    work = dist.all_reduce(t, async_op=True)
    out["async_value"] = work.get_future().wait()[0].clone()
    assert work.wait() and work.is_completed()
    out["async"] = t
    # tensor allgather / reduce-scatter, both spellings and the stack form
    n = 40_000
    for name, call in _spellings("all_gather_single", "all_gather_into_tensor"):
        o = torch.empty(world * n)
        call(o, _values(rank, n, seed=4))
        out[f"all_gather_{name}"] = o
    stacked = torch.empty(world, 100)  # NCCL's stack form: gloo refuses it, and so must we
    out["all_gather_stacked"] = _error(lambda: all_gather_single(stacked, _values(rank, 100, seed=5)))
    for name, call in _spellings("reduce_scatter_single", "reduce_scatter_tensor"):
        o = torch.empty(n)
        call(o, _values(rank, world * n, seed=6))
        out[f"reduce_scatter_{name}"] = o
    pg = dist.group.WORLD
    o, i = torch.empty(world * 64), _values(rank, 64, seed=7)
    pg._allgather_base(o, i).wait()
    out["allgather_base"] = o
    o, i = torch.empty(64), _values(rank, world * 64, seed=8)
    pg._reduce_scatter_base(o, i).wait()
    out["reduce_scatter_base"] = o
    outs = [torch.empty(world * 64), torch.empty(world * 32)]
    pg.allgather_into_tensor_coalesced(outs, [_values(rank, 64, seed=21), _values(rank, 32, seed=22)]).wait()
    out["allgather_into_tensor_coalesced"] = outs
    outs = [torch.empty(64), torch.empty(32)]
    error = _error(lambda: pg.reduce_scatter_tensor_coalesced(
        outs, [_values(rank, world * 64, seed=23), _values(rank, world * 32, seed=24)]).wait())
    out["reduce_scatter_tensor_coalesced"] = error or outs
    # list forms and the rest: delegated to gloo
    lst = [torch.empty(10) for _ in range(world)]
    dist.all_gather(lst, _values(rank, 10, seed=9))
    out["all_gather_list"] = torch.stack(lst)
    rs = torch.empty(10)
    error = _error(lambda: dist.reduce_scatter(rs, [_values(rank, 10, seed=10 + r) for r in range(world)]))
    out["reduce_scatter_list"] = error or rs
    b = _values(rank, 100, seed=11)
    dist.broadcast(b, src=world - 1)
    out["broadcast"] = b
    r = _values(rank, 100, seed=12)
    dist.reduce(r, dst=1)
    out["reduce"] = r if rank == 1 else None
    dist.barrier()
    a2a = [torch.empty(5) for _ in range(world)]
    dist.all_to_all(a2a, [_values(rank, 5, seed=13 + k) for k in range(world)])
    out["all_to_all"] = torch.stack(a2a)
    single = torch.empty(world * 5)
    dist.all_to_all_single(single, _values(rank, world * 5, seed=14))
    out["all_to_all_single"] = single
    g = [torch.empty(6) for _ in range(world)] if rank == 0 else None
    dist.gather(_values(rank, 6, seed=15), g, dst=0)
    out["gather"] = torch.stack(g) if g else None
    s = torch.empty(6)
    dist.scatter(s, [_values(0, 6, seed=16 + k) for k in range(world)] if rank == 0 else None, src=0)
    out["scatter"] = s
    if rank in (0, 1):
        peer = _values(rank, 7, seed=17)
        (dist.send if rank == 0 else dist.recv)(peer, 1 - rank)
        out["send_recv"] = peer
    objs: list = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "sq": rank * rank})
    out["all_gather_object"] = objs
    box = [f"from {rank}", rank] if rank == 2 else [None, None]
    dist.broadcast_object_list(box, src=2)
    out["broadcast_object_list"] = box
    dist.monitored_barrier()
    # subgroups: new_group(backend=None) inherits the default group's backend
    even = dist.new_group([r for r in range(world) if r % 2 == 0])
    odd = dist.new_group([r for r in range(world) if r % 2 == 1])
    mine = even if rank % 2 == 0 else odd
    t = _values(rank, 200_000, seed=18)
    dist.all_reduce(t, group=mine)
    out["subgroup_all_reduce"] = t
    o = torch.empty(2 * 1000)
    all_gather_single(o, _values(rank, 1000, seed=19), group=mine)
    out["subgroup_all_gather"] = o
    local = dist.new_group([rank], use_local_synchronization=True)
    t = _values(rank, 10, seed=20)
    dist.all_reduce(t, group=local)
    out["singleton_group"] = t
    out["_backend"] = str(dist.get_backend())
    out["_subgroup_backend"] = str(dist.get_backend(mine))
    if isinstance(pg, SlipstreamProcessGroup):
        probe = torch.empty(600_000)
        out["_algorithm"] = pg.communicator.algorithm(probe)[0]
        out["_subgroup_fast"] = isinstance(mine, SlipstreamProcessGroup) and mine.communicator is not None
    return _bytes(out)


def _run(backend: str, rank_env=None, timeout=240) -> list[dict]:
    return _load(run_ranks(_collectives, 4, backend=backend, rank_env=rank_env, timeout=timeout,
                           pg_timeout=min(120, timeout / 2)))


def _assert_same(ours, stock, where: str = "") -> None:
    """Tensors with ``assert_close`` (exact for integers), everything else with ``==``;
    keys starting with ``_`` are backend-specific and skipped."""
    if isinstance(stock, torch.Tensor):
        assert_close(ours, stock, msg=lambda m: f"{where}: {m}")
    elif isinstance(stock, dict):
        public = lambda d: {k for k in d if not str(k).startswith("_")}  # noqa: E731
        assert public(ours) == public(stock), where
        for key in stock:
            if not str(key).startswith("_"):
                _assert_same(ours[key], stock[key], f"{where}[{key!r}]")
    elif isinstance(stock, (list, tuple)):
        assert len(ours) == len(stock), where
        for i, (o, s) in enumerate(zip(ours, stock)):
            _assert_same(o, s, f"{where}[{i}]")
    else:
        assert ours == stock, f"{where}: {ours!r} != {stock!r}"


@pytest.mark.parametrize("layout", ["1x4", "2x2"])
def test_public_collectives_match_gloo(layout):
    rank_env = TWO_NODES if layout == "2x2" else None
    stock, ours = _run("gloo", rank_env, timeout=120), _run("slipstream", rank_env, timeout=120)
    _assert_same(ours, stock)
    for o in ours:
        assert o["_backend"] == o["_subgroup_backend"] == "slipstream"
        assert o["_algorithm"] == ("hierarchical" if layout == "2x2" else "shm")
        assert o["_subgroup_fast"]
        reference = sum(_values(r, 2000).view(1000, 2)[:, 0] for r in range(4))
        assert_close(o["_all_reduce_strided"], reference)


def _new_group_local_sync(rank: int, world: int) -> list:
    """Subgroups created by their members only, in different orders on different ranks."""
    pairs = [[0, 1], [2, 3]] if rank < 2 else [[2, 3], [0, 1]]
    results = []
    for ranks in pairs:
        group = dist.new_group(ranks, use_local_synchronization=True)
        if rank in ranks:
            t = _values(rank, 100_000, seed=ranks[0])
            dist.all_reduce(t, group=group)
            results.append(t)
    return _bytes(results)


def test_local_synchronization_subgroups_match_gloo():
    stock = _load(run_ranks(_new_group_local_sync, 4, timeout=240))
    ours = _load(run_ranks(_new_group_local_sync, 4, backend="slipstream", timeout=240))
    _assert_same(ours, stock)


def _options_and_refusals(rank: int, world: int) -> dict:
    """Calls the core refuses go to gloo: per-call timeout, several tensors, op overload."""
    pg = dist.group.WORLD
    out = {}
    t = _values(rank, 5000)
    pg.allreduce([t], dist.AllreduceOptions()).wait()
    out["opts"] = t
    t = _values(rank, 5000, seed=1)
    pg.allreduce(t, dist.ReduceOp.MAX).wait()  # the (tensor, op) overload
    out["overload"] = t
    opts = dist.AllreduceOptions()
    from datetime import timedelta

    opts.timeout = timedelta(seconds=30)
    t = _values(rank, 5000, seed=2)
    pg.allreduce([t], opts).wait()
    out["timeout"] = t
    out["mismatch_error"] = _error(lambda: all_gather_single(torch.empty(3), torch.ones(2)))
    return _bytes(out)


def test_refused_calls_behave_as_gloo():
    stock = _load(run_ranks(_options_and_refusals, 2, timeout=240))
    ours = _load(run_ranks(_options_and_refusals, 2, backend="slipstream", timeout=240))
    _assert_same(ours, stock)


def test_pg_options_must_be_a_comm_config():
    from slipstream.core_comm.backend.process_group import create_process_group

    with pytest.raises(TypeError, match="CommConfig"):
        create_process_group(None, pg_options=object())
