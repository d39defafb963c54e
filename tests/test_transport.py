"""The multi-connection inter-node transport against gloo, on loopback ranks."""

import argparse
import json
import os
import time

import pytest
import torch
import torch.distributed as dist

from _dist import free_port, run_ranks
from slipstream.bench import transport as bench
from slipstream.core_comm import CommConfig, Communicator
from slipstream.core_comm.transport import tcp as transport
from slipstream.core_comm.compat import all_gather_into_tensor, reduce_scatter_tensor
from slipstream.core_comm.transport.tcp import MultiConnInter, TransportError, _split, endpoint_from_env

R = dist.ReduceOp
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo"}
DTYPES = [torch.float32, torch.bfloat16, torch.int64]
SIZES = [0, 1, 13, 1031, (1 << 20) + 7]  # empty, one, primes, 4 MiB of fp32


def _data(rank, seed, n, dtype):
    """Small integers: every dtype sums them exactly in any order, so results compare bitwise."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randint(-4, 5, (n,), generator=g).to(dtype)


def _check_ops(t, rank, world, seed, dtype, n, op):
    x = _data(rank, seed, n, dtype)
    ref = x.clone()
    dist.all_reduce(ref, op=op)
    t.all_reduce(x, op)
    assert torch.equal(x, ref), ("all_reduce", dtype, n, op)
    full = _data(rank, seed + 1, n * world, dtype)
    rs, rs_ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
    reduce_scatter_tensor(rs_ref, full.clone(), op=op)
    t.reduce_scatter(rs, full, op)
    assert torch.equal(rs, rs_ref), ("reduce_scatter", dtype, n, op)
    ag, ag_ref = torch.empty(n * world, dtype=dtype), torch.empty(n * world, dtype=dtype)
    all_gather_into_tensor(ag_ref, x)
    t.all_gather(ag, x)
    assert torch.equal(ag, ag_ref), ("all_gather", dtype, n)


def _matches_gloo(rank, world):
    seed = 0
    transport._MIN_PIECE = 4  # split even the small sizes across lanes (some pieces empty)
    for k in (1, 4):
        with MultiConnInter(dist.group.WORLD, connections=k, timeout_s=60) as t:
            for dtype in DTYPES:
                for n in SIZES:
                    seed += 2
                    _check_ops(t, rank, world, seed, dtype, n, R.SUM)
            for op in (R.MAX, R.MIN, R.PRODUCT):
                seed += 2
                _check_ops(t, rank, world, seed, torch.float32, 1031, op)
            _forked_child_closes_its_copy(t)
            # Async calls queued back to back finish in order with the right results.
            xs = [_data(rank, seed + i, 4099 * (i + 1), torch.float32) for i in range(4)]
            refs = [x.clone() for x in xs]
            works = [t.all_reduce(x, R.SUM, async_op=True) for x in xs]
            for ref in refs:
                dist.all_reduce(ref)
            for w, x, ref in zip(works, xs, refs):
                w.wait()
                assert torch.equal(x, ref)
    return seed


def _forked_child_closes_its_copy(t):
    """A forked child (a DataLoader worker) closing the transport leaves the parent's working."""
    pid = os.fork()
    if pid == 0:
        t.close()
        os._exit(0)
    os.waitpid(pid, 0)
    x = torch.ones(1 << 16)
    t.all_reduce(x, R.SUM)
    assert torch.equal(x, torch.full_like(x, dist.get_world_size()))


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_match_gloo_for_two_and_three_nodes(world):
    run_ranks(_matches_gloo, world, env=LOOPBACK, timeout=120)


def _through_communicator(rank, world):
    cfg = CommConfig(connections=4, chunk_bytes=64 << 10, slot_bytes=64 << 10, small_bytes=4096, timeout_s=60)
    comm = Communicator(None, config=cfg)
    assert isinstance(comm.hier.inter, MultiConnInter)
    for seed, (n, op) in enumerate([(1031, R.SUM), ((1 << 18) + 3, R.SUM), (4096, R.MAX), (999, R.AVG)]):
        x = _data(rank, seed, n, torch.float32)
        ref = x.clone()
        dist.all_reduce(ref, op=op)
        comm.all_reduce(x, op)
        torch.testing.assert_close(x, ref, rtol=0, atol=0)
        full = _data(rank, seed + 50, n * world, torch.float32)
        rs, rs_ref = torch.empty(n), torch.empty(n)
        reduce_scatter_tensor(rs_ref, full.clone(), op=op)
        comm.reduce_scatter(rs, full, op)
        torch.testing.assert_close(rs, rs_ref, rtol=0, atol=0)
        ag, ag_ref = torch.empty(n * world), torch.empty(n * world)
        all_gather_into_tensor(ag_ref, x)
        comm.all_gather(ag, x)
        assert torch.equal(ag, ag_ref)
    x = _data(rank, 99, 1 << 17, torch.float32)
    ref = x.clone()
    work = comm.all_reduce(x, async_op=True)
    dist.all_reduce(ref)
    work.wait()
    assert torch.equal(x, ref)
    comm.close()


def test_hierarchical_path_over_four_connections_matches_gloo():
    nodes = [{"SLIPSTREAM_NODE": str(n)} for n in (0, 0, 1, 1)]
    run_ranks(_through_communicator, 4, env=LOOPBACK, rank_env=nodes, timeout=120)


def _size_mismatch(rank, world):
    t = MultiConnInter(dist.group.WORLD, connections=2, timeout_s=20)
    theirs, mine = 1001 - rank, 1000 + rank
    with pytest.raises(TransportError, match=f"mismatch.*it called all_reduce #0 of {theirs} torch.float32, "
                                             f"this rank called all_reduce #0 of {mine} "):
        t.all_reduce(torch.ones(mine))
    with pytest.raises(TransportError, match="unusable"):
        t.all_reduce(torch.ones(4))
    dist.barrier()  # both have read the other's header before either closes
    t.close()


@pytest.mark.faults
def test_size_mismatch_between_peers_raises_on_both():
    run_ranks(_size_mismatch, 2, env=LOOPBACK, timeout=60)


def _foreign_connections(rank, world):
    """Before the peer's connections, each of rank 0's listeners gets three foreign ones: a
    silent one, one that sends garbage, one that greets with a wrong token."""
    import socket

    from slipstream.core_comm.transport import _lanes as _tcp

    _tcp._GREETING_S = 0.5
    foreign = []
    listen = _tcp._listen

    def listen_then_knock(*args):
        listeners = listen(*args)
        for sock in listeners:
            where = sock.getsockname()
            for greeting in (b"", b"GET / HTTP/1.0\r\n\r\n" + bytes(32), _tcp._HELLO.pack(_tcp._MAGIC, bytes(16), 1, 0)):
                foreign.append(socket.create_connection(where, timeout=5))
                foreign[-1].sendall(greeting)
        return listeners

    _tcp._listen = listen_then_knock if rank == 0 else listen
    try:
        with MultiConnInter(dist.group.WORLD, connections=2, timeout_s=20) as t:
            x = _data(rank, 7, 4099, torch.float32)
            ref = x.clone()
            dist.all_reduce(ref)
            t.all_reduce(x)
            assert torch.equal(x, ref)
    finally:
        _tcp._listen = listen
        for sock in foreign:
            sock.close()
    return len(foreign)


@pytest.mark.faults
def test_foreign_connections_during_set_up_are_ignored():
    assert run_ranks(_foreign_connections, 2, env=LOOPBACK, timeout=60) == [6, 0]


def _port_blocks(rank, world, base):
    ports = range(base, base + 16)
    first = MultiConnInter(dist.group.WORLD, connections=2, timeout_s=20, ports=ports)
    second = MultiConnInter(dist.group.WORLD, connections=2, timeout_s=20, ports=ports)
    if rank == 0:  # with 2 peers, rank 0 listens: its block, then its next block (the first is held)
        assert [s.getsockname()[1] for s in first._lanes.recv_socks] == [base, base + 1]
        assert [s.getsockname()[1] for s in second._lanes.recv_socks] == [base + 4, base + 5]
        with pytest.raises(TransportError, match="no 2 free ports for global rank 0"):
            transport._listen("127.0.0.1", range(base, base + 6), 2, 20)
    x = torch.ones(1 << 18)
    first.all_reduce(x)
    second.all_reduce(x)
    assert torch.equal(x, torch.full_like(x, 4.0))
    first.close()
    second.close()


def test_each_transport_listens_on_a_port_block_of_its_own():
    run_ranks(_port_blocks, 2, free_port(), env=LOOPBACK, timeout=60)


def _peer_hangs_or_dies(rank, world, timeout_s):
    hanging = MultiConnInter(dist.group.WORLD, connections=4, timeout_s=timeout_s)
    dying = MultiConnInter(dist.group.WORLD, connections=4, timeout_s=60)
    closing = MultiConnInter(dist.group.WORLD, connections=4, timeout_s=60)
    if rank == 1:
        time.sleep(timeout_s + 2)  # alive, but never calls: rank 0 times out
        raise RuntimeError("rank 1 exits: the kernel closes its sockets")
    work = closing.all_reduce(torch.ones(1 << 20), async_op=True)  # rank 1 never joins
    closing.close()
    with pytest.raises(TransportError, match="closed"):
        work.wait()
    start = time.monotonic()
    with pytest.raises(TransportError, match="no progress.*has died, hangs"):
        hanging.all_reduce(torch.ones(1 << 16))
    hung = time.monotonic() - start
    start = time.monotonic()
    with pytest.raises(TransportError, match="connection lost.*exited or failed"):
        dying.all_reduce(torch.ones(1 << 20))
    return hung, time.monotonic() - start


@pytest.mark.faults
def test_peer_that_hangs_or_dies_raises_within_the_timeout_and_close_ends_calls():
    ranks = run_ranks(_peer_hangs_or_dies, 2, 2.0, env=LOOPBACK, timeout=60, allow_failures=True)
    assert isinstance(ranks[1], Exception) and "rank 1 exits" in str(ranks[1])
    hung, died = ranks[0]
    assert 1.9 < hung < 4.0
    assert died < 10.0  # the exit, not the 60 s timeout


def test_split_covers_the_range_in_order():
    assert _split(3, 13, 4) == [(3, 5), (5, 8), (8, 10), (10, 13)]
    assert _split(0, 2, 4) == [(0, 0), (0, 1), (1, 1), (1, 2)]


def test_endpoint_from_env():
    assert endpoint_from_env({"GLOO_SOCKET_IFNAME": "lo", "SLIPSTREAM_PORT_BASE": "20000"}) == (
        "127.0.0.1", range(20000, 65536))
    assert endpoint_from_env({"GLOO_SOCKET_IFNAME": "lo,eth0"})[1] is None
    with pytest.raises(TransportError, match="no-such-if"):
        endpoint_from_env({"GLOO_SOCKET_IFNAME": "no-such-if"})
    with pytest.raises(ValueError, match="SLIPSTREAM_PORT_BASE"):
        endpoint_from_env({"GLOO_SOCKET_IFNAME": "lo", "SLIPSTREAM_PORT_BASE": "x"})


@pytest.mark.parametrize("kwargs, match", [({"connections": 0}, "between 1 and 16"),
                                           ({"connections": 17}, "between 1 and 16"),
                                           ({"timeout_s": 0}, "positive")])
def test_bad_settings_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiConnInter(None, **kwargs)


@pytest.mark.netns
def test_bench_transport_runs_on_two_emulated_nodes(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "records.json"
    args = parser.parse_args(["--size", "256K", "--iters", "1", "--warmup", "0", "--json", str(out)])
    assert bench.run(args) == 0
    records = json.loads(out.read_text())
    assert [r["impl"] for r in records] == ["gloo", "K=1", "K=4"]
    assert all(r["time_s"] > 0 and r["bound_s"] > 0 for r in records)
