"""The communicator against gloo: every placement of ranks on (override-emulated) nodes."""

import mmap

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from slipstream.core_comm import CommConfig, Communicator, ShmError, counters
from slipstream.core_comm.routing import Choice
from slipstream.core_comm.topology import Topology, resolve_keys

R = dist.ReduceOp
# Small chunks and slots so that modest tensors run several pipeline steps.
SMALL = CommConfig(slot_bytes=4096, small_bytes=512, chunk_bytes=2048, timeout_s=60)
DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8]


def _nodes(*node_of):
    return [{"SLIPSTREAM_NODE": str(n)} for n in node_of]


def _data(rank, seed, n, dtype):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 50, (n,), generator=g).to(dtype)


def _assert_matches(got, ref):
    if got.dtype.is_floating_point:
        tol = 5e-2 if got.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.double(), ref.double(), rtol=tol, atol=tol)
    else:
        assert torch.equal(got, ref)


def _compare_with_gloo(comm, group, rank, world, sizes):
    """Every collective through ``comm`` equals gloo's on ``group``."""
    seed = 0
    for dtype in DTYPES:
        ops = [R.SUM, R.MAX, R.MIN] + ([R.AVG] if dtype.is_floating_point else [])
        for op in ops:
            for n in sizes:
                seed += 1
                x = _data(rank, seed, n, dtype)
                ref = x.clone()
                dist.all_reduce(ref, op=R.SUM if op == R.AVG else op, group=group)
                if op == R.AVG:
                    ref = (ref.double() / world).to(dtype)
                comm.all_reduce(x, op)
                _assert_matches(x, ref)
                full = _data(rank, seed + 5000, n * world, dtype)
                rs_ref = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(rs_ref, full.clone(), op=R.SUM if op == R.AVG else op, group=group)
                if op == R.AVG:
                    rs_ref = (rs_ref.double() / world).to(dtype)
                rs = torch.empty(n, dtype=dtype)
                comm.reduce_scatter(rs, full, op)
                _assert_matches(rs, rs_ref)
        for n in sizes:
            piece = _data(rank, seed + n, n, dtype)
            ag_ref = torch.empty(n * world, dtype=dtype)
            dist.all_gather_into_tensor(ag_ref, piece, group=group)
            ag = torch.empty_like(ag_ref)
            comm.all_gather(ag, piece)
            assert torch.equal(ag, ag_ref)
    return seed


class _AlwaysHierarchical:
    """A plan choosing the hierarchical path at every size."""

    source = "test"

    def choose(self, kind, nbytes, dtype):
        return Choice("hierarchical")


def _gloo_groups() -> int:
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map)


def _on_world(rank, world, expected_algo):
    before = _gloo_groups()
    comm = Communicator(None, config=SMALL)
    made = _gloo_groups() - before
    algo, why = comm.algorithm(torch.ones(1000))
    assert algo == expected_algo, (algo, why)
    if comm.hier is not None and comm.topology.local_size == 1:
        # small calls of one rank per node go to stock by the built-in rule; a plan sends
        # them through the hierarchical path, which is what is compared here
        assert "one rank per node" in why
        # the bytes that cross the node link are counted on the stock path as on the hierarchical one
        sent = {}
        for plan in (None, _AlwaysHierarchical()):
            comm.plan = plan
            counters.reset()
            comm.all_reduce(torch.ones(1024))
            comm.all_gather(torch.empty(1024 * world), torch.ones(1024))
            comm.reduce_scatter(torch.empty(1024), torch.ones(1024 * world))
            sent[plan is None] = counters.link_bytes()
        # allreduce 2(n-1)/n of its 4 KiB; allgather and reduce-scatter (n-1)/n of their n x 4 KiB
        assert sent[True] == 2 * (world - 1) * 4096 // world + 2 * (world - 1) * 4096, sent
        assert abs(sent[False] - sent[True]) <= 8, sent  # the hierarchical path rounds per chunk
        comm.plan = _AlwaysHierarchical()
        assert comm.algorithm(torch.ones(1000))[0] == "hierarchical"
    _compare_with_gloo(comm, None, rank, world, [0, 1, 13, 1031])
    held = comm.held_bytes()
    if comm.shm is None and comm.hier is None:  # the stock path keeps nothing of ours
        assert held == 0
    elif comm.shm is not None:  # at least the node's segment, as this process maps it (in whole pages)
        mapped = _mapped_bytes(comm.shm.segment_name)
        assert mapped > 0 and held > mapped - mmap.PAGESIZE, (held, mapped)
    _compare_with_gloo(comm, None, rank, world, [1031])
    assert comm.held_bytes() == held  # what the calls keep is kept, not grown by calls of sizes seen before
    comm.close()
    return comm.topology.node_of, made, _gloo_groups() - before


def _mapped_bytes(path: str) -> int:
    """The bytes of this process's mappings of ``path`` (``/proc/self/maps``)."""
    total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            if path in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                total += hi - lo
    return total


@pytest.mark.parametrize(
    "node_of, algo, groups",
    [
        ((0, 0, 1, 1), "hierarchical", 2),  # 2 nodes x 2 ranks: intra- and inter-node groups
        ((0, 1, 0, 1), "hierarchical", 2),  # ranks of a node not consecutive
        ((0, 1, 2), "stock", 1),            # one rank per node: no shared memory, inter only; small: stock
        ((0, 0, 0, 1), "stock", 0),         # uneven nodes fall back to the stock collective
        ((0, 0, 0), "shm", 0),              # one node: the gloo group is its own intra-node group
    ],
)
def test_collectives_match_gloo_for_every_placement(node_of, algo, groups):
    seen = run_ranks(_on_world, len(node_of), algo, rank_env=_nodes(*node_of), timeout=300)
    assert all(s[0] == seen[0][0] for s in seen)
    # the gloo groups the communicator made, and none left once it is closed
    assert all(made == groups and left == 0 for _, made, left in seen), seen


def _on_subgroup(rank, world):
    # A data-parallel group {0, 2, 4, 6}-style subgroup inside a world of 4: ranks 1 and 3.
    sub_ranks = [1, 3]
    other = [0, 2]
    sub = dist.new_group(sub_ranks)
    rest = dist.new_group(other)
    group = sub if rank in sub_ranks else rest
    comm = Communicator(group, config=SMALL)
    n = _compare_with_gloo(comm, group, dist.get_rank(group), 2, [1, 1031])
    comm.close()
    return n


def test_subgroups_inside_a_bigger_world_match_gloo():
    # World ranks 0,1 on node 0 and 2,3 on node 1: each subgroup spans both nodes.
    run_ranks(_on_subgroup, 4, rank_env=_nodes(0, 0, 1, 1), timeout=300)


def _fallbacks_and_async(rank, world):
    comm = Communicator(None, config=SMALL)
    # An op the core does not implement goes to gloo and is still right.
    x = torch.tensor([rank + 1, 6], dtype=torch.int32)
    comm.all_reduce(x, R.BAND)
    ref = torch.tensor([rank + 1, 6], dtype=torch.int32)
    dist.all_reduce(ref, R.BAND)
    assert torch.equal(x, ref)
    assert comm.algorithm(x, R.BAND)[0] == "stock" and "op" in comm.algorithm(x, R.BAND)[1]
    # A dtype it does not implement too.
    c = torch.full((3,), float(rank), dtype=torch.complex64)
    comm.all_reduce(c)
    assert torch.allclose(c, torch.full((3,), float(sum(range(world))), dtype=torch.complex64))
    # Async handles: several in flight, then wait; order kept with a following sync call.
    ts = [torch.full((5000,), float(rank + k)) for k in range(3)]
    works = [comm.all_reduce(t, async_op=True) for t in ts]
    y = torch.ones(10)
    comm.all_reduce(y)
    for k, w in enumerate(works):
        w.wait()
        assert torch.all(ts[k] == sum(range(world)) + world * k)
    assert torch.all(y == world)
    out = torch.empty(world * 7)
    comm.all_gather(out, torch.full((7,), float(rank)), async_op=True).wait()
    assert torch.equal(out.view(world, 7)[:, 0], torch.arange(world, dtype=torch.float32))
    # Mixed devices and ill-fitting sizes are refused with a clear message.
    with pytest.raises(ValueError, match="different devices"):
        comm.all_gather(torch.empty(world * 4, device="meta"), torch.ones(4))
    with pytest.raises(ValueError, match="world_size"):
        comm.reduce_scatter(torch.empty(3), torch.ones(3 * world + 1))
    comm.close()
    return True


def test_unsupported_ops_and_dtypes_fall_back_and_async_handles_complete():
    run_ranks(_fallbacks_and_async, 2, rank_env=_nodes(0, 0), timeout=120)


def test_fallbacks_and_async_across_nodes():
    run_ranks(_fallbacks_and_async, 4, rank_env=_nodes(0, 0, 1, 1), timeout=180)


def _different_sizes(rank, world, debug):
    comm = Communicator(None, config=CommConfig(debug=debug, timeout_s=30))
    try:
        comm.all_reduce(torch.ones(100 + rank))
    except (ValueError, ShmError) as e:
        return type(e).__name__, str(e)
    return "none", ""


@pytest.mark.parametrize("debug", [True, False])
def test_tensors_of_different_sizes_across_ranks_raise_a_clear_error(debug):
    for kind, msg in run_ranks(_different_sizes, 2, debug, rank_env=_nodes(0, 0), timeout=120):
        assert kind == ("CollectiveMismatch" if debug else "ShmError")
        assert "differs" in msg and "100" in msg and "101" in msg


def test_topology_keys_prefer_override_and_reject_cross_host_nodes():
    host = "h/boot"
    keys = resolve_keys([(("override", "a"), host), (("override", "b"), host)])
    assert Topology.from_keys(keys, 0).node_of == (0, 1)
    # Launcher node ranks are used when every rank has one.
    keys = resolve_keys([(("launcher", "0"), host), (("launcher", "0"), host), (("launcher", "1"), host)])
    assert Topology.from_keys(keys, 2).node_of == (0, 0, 1)
    # A mix of sources falls back to the host identity.
    assert resolve_keys([(("launcher", "0"), "x"), (None, "y")]) == ["x", "y"]
    with pytest.raises(ValueError, match="some ranks but not"):
        resolve_keys([(("override", "a"), host), (None, host)])
    with pytest.raises(ValueError, match="share a host"):
        resolve_keys([(("override", "a"), "h1/b"), (("override", "a"), "h2/b")])
    topo = Topology((0, 1, 0, 1), 3)
    assert topo.local_ranks == (1, 3) and topo.local_rank == 1 and topo.peers(0) == (0, 1)
    assert not Topology((0, 0, 0, 1), 0).is_uniform


def test_a_collective_across_nodes_is_chunked_by_a_quarter_rounded_down_to_a_power_of_two():
    """So that a chunk's temporaries come in a few sizes, which the path's arenas reach early;
    never below the configured chunk, and a chunk the tuner chose is kept. A reduce-scatter's
    or allgather's quarter (of its larger buffer) stops at ``RESIZE_CHUNK_MOST``."""
    class Path:
        def all_reduce(self, flat, op, chunk_bytes, inter):
            seen.append(chunk_bytes)

        def reduce_scatter(self, out, inp, op, chunk_bytes, valid, inter):
            seen.append(chunk_bytes)

        def all_gather(self, out, inp, chunk_bytes, inter):
            seen.append(chunk_bytes)

    comm = Communicator.__new__(Communicator)
    comm.hier, comm.config, seen = Path(), CommConfig(), []
    sizes = [1 << 20, 16 << 20, (17 << 20) + 64, (32 << 20) - 4, 32 << 20, 48 << 20, (64 << 20) - 4, 64 << 20,
             100 << 20]
    for nbytes in sizes:
        comm._cpu_all_reduce(torch.empty(nbytes // 4), dist.ReduceOp.SUM, None)
    assert [c >> 20 for c in seen] == [4, 4, 4, 4, 8, 8, 8, 16, 16]
    comm._cpu_all_reduce(torch.empty(1 << 20), dist.ReduceOp.SUM, 3 << 20)
    assert seen[-1] == 3 << 20
    seen.clear()
    world = 4
    for nbytes in [1 << 20, 32 << 20, 64 << 20, 128 << 20, 512 << 20]:
        n = nbytes // 4 // world
        comm._resize("reduce_scatter", "hierarchical", torch.empty(n), torch.empty(world * n), dist.ReduceOp.SUM)
        comm._resize("all_gather", "hierarchical", torch.empty(world * n), torch.empty(n), None)
    assert [c >> 20 for c in seen] == [4, 4, 8, 8, 16, 16, 16, 16, 16, 16]
    comm.config = CommConfig(chunk_bytes=64 << 20)  # the configured chunk is the least, past the most
    comm._resize("all_gather", "hierarchical", torch.empty(world), torch.empty(1), None)
    assert seen[-1] == 64 << 20


def _settings_warnings(rank, world):
    """The pool's warning about a communicator asked for other settings than it was built
    with: built with the defaults (no config given), then asked with the same settings
    spelled out, then with other ones."""
    import logging

    from slipstream.core_comm import pool

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("slipstream").addHandler(handler)
    group = dist.new_group([0, 1])
    built = pool.get(group)
    same = pool.get(group, config=pool.POOL.default_config())
    before = len(seen)
    pool.get(group, config=CommConfig(timeout_s=17))
    logging.getLogger("slipstream").removeHandler(handler)
    return same is built, before, [m for m in seen if "was built with" in m]


def test_the_pool_warns_only_when_asked_for_other_settings_than_its_communicator_has():
    for same, before, warned in run_ranks(_settings_warnings, 2, rank_env=_nodes(0, 0), timeout=120):
        assert same and before == 0, warned  # the defaults, spelled out: the same settings
        assert len(warned) == 1 and "timeout_s=17" in warned[0], warned
