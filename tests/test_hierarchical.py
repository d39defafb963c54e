"""The pipelined hierarchical reduce-scatter, allgather and allreduce against gloo, for every
chunk size, on (override-emulated) 2 x 2, 3 x 1 and 2 x 1 nodes, and on one node."""

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from slipstream.core_comm import CommConfig, Communicator
from slipstream.core_comm.compat import all_gather_into_tensor, reduce_scatter_tensor
from slipstream.core_comm.collectives.hierarchical import Hierarchical, _ramped, _rows, _select
from slipstream.core_comm.transport.gloo import GlooInter
from slipstream.core_comm.collectives.shm import ShmComm
from slipstream.core_comm.scratch import KEPT, Scratch, fresh
from slipstream.core_comm.topology import Topology

R = dist.ReduceOp
OPS = {torch.float32: (R.SUM, R.MAX, R.AVG), torch.bfloat16: (R.SUM, R.AVG), torch.int64: (R.SUM, R.MAX)}
BLOCKS = (0, 1, 7, 37)  # elements per rank's block: empty, one, primes
# Bytes per chunk: one column per chunk, a few columns (37 does not divide), one chunk.
CHUNKS = (1, 100, 1 << 20)
CONFIG = CommConfig(slot_bytes=4096, small_bytes=512, chunk_bytes=2048, timeout_s=60)


def _nodes(*node_of):
    return [{"SLIPSTREAM_NODE": str(n)} for n in node_of]


def _data(rank, seed, n, dtype):
    # Small integers: every sum is exact in every dtype and order, so results compare exactly.
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randint(-8, 9, (n,), generator=g).to(dtype)


def _gloo_reduce_scatter(full, n, op, world):
    ref = torch.empty(n, dtype=full.dtype)
    reduce_scatter_tensor(ref, full.clone(), op=R.SUM if op == R.AVG else op)
    return (ref.double() / world).to(full.dtype) if op == R.AVG else ref


def _check_against_gloo(hier, rank, world):
    """Every (dtype, op, block size, chunk size) of ``hier``'s reduce-scatter and allgather:
    exactly the one-chunk result, and gloo's."""
    seed = 0
    for dtype, ops in OPS.items():
        for n in BLOCKS:
            seed += 1
            for op in ops:
                full = _data(rank, seed, n * world, dtype)
                ref = _gloo_reduce_scatter(full, n, op, world)
                results = []
                for chunk in CHUNKS:
                    out = torch.empty(n, dtype=dtype)
                    hier.reduce_scatter(out, full, op, chunk_bytes=chunk)
                    results.append(out)
                for chunk, out in zip(CHUNKS, results):
                    assert torch.equal(out, results[-1]), (dtype, op, n, chunk)
                if op == R.AVG:
                    torch.testing.assert_close(results[-1], ref, rtol=1e-2, atol=1e-6)
                else:
                    assert torch.equal(results[-1], ref), (dtype, op, n)
                    _check_unequal_blocks(hier, full, n, op, world, rank, seed)
                _check_all_reduce(hier, full, op, world)
            piece = _data(rank, seed + 1000, n, dtype)
            ref = torch.empty(n * world, dtype=dtype)
            all_gather_into_tensor(ref, piece)
            for chunk in CHUNKS:
                out = torch.full((n * world,), 99, dtype=dtype)
                hier.all_gather(out, piece, chunk_bytes=chunk)
                assert torch.equal(out, ref), (dtype, n, chunk)
                # FSDP2 gathers from a view into the output.
                out = torch.zeros(n * world, dtype=dtype)
                out.view(world, n)[rank].copy_(piece)
                hier.all_gather(out, out.view(world, n)[rank], chunk_bytes=chunk)
                assert torch.equal(out, ref), (dtype, n, chunk, "input inside output")
    return True


def _check_all_reduce(hier, full, op, world):
    """The allreduce of ``full`` in place, in every chunking: gloo's result (with one rank per
    node the chunks themselves cross the link, with no copy)."""
    ref = full.clone()
    dist.all_reduce(ref, op=R.SUM if op == R.AVG else op)
    for chunk in CHUNKS:
        got = full.clone()
        hier.all_reduce(got, op, chunk_bytes=chunk)
        if op == R.AVG:
            torch.testing.assert_close(got, (ref.double() / world).to(full.dtype), rtol=1e-2, atol=1e-6)
        else:
            assert torch.equal(got, ref), (full.dtype, op, full.numel(), chunk)


def _check_unequal_blocks(hier, full, n, op, world, rank, seed):
    """Blocks whose tails are zero padding (``valid``): the real part equals gloo's on the
    padded input, in every chunking."""
    valid = [(r * 5 + seed) % (n + 1) for r in range(world)]
    padded = full.clone().view(world, n)
    for r, v in enumerate(valid):
        padded[r, v:] = 0
    ref = _gloo_reduce_scatter(padded.view(-1), n, op, world)
    for chunk in CHUNKS:
        out = torch.full((n,), 99, dtype=full.dtype)
        hier.reduce_scatter(out, padded.view(-1), op, chunk_bytes=chunk, valid=valid)
        assert torch.equal(out[:valid[rank]], ref[:valid[rank]]), (full.dtype, op, n, chunk, valid)


def _link_bytes_of_unequal_blocks(rank, world):
    """Across 2 nodes x 2, a reduce-scatter of blocks with 10, 20, 30, 40 real elements out
    of 1000: each rank sends its peer on the other node only that peer's real elements."""
    from slipstream.core_comm import counters

    comm = Communicator(None, config=CONFIG)
    try:
        inp, out, valid = torch.zeros(world * 1000), torch.empty(1000), [10, 20, 30, 40]
        counters.reset()
        comm.reduce_scatter(out, inp, valid=valid)
        return counters.link_bytes()
    finally:
        comm.close()


def test_a_reduce_scatter_of_unequal_blocks_sends_only_their_real_elements_across_nodes():
    sent = run_ranks(_link_bytes_of_unequal_blocks, 4, rank_env=_nodes(0, 0, 1, 1), timeout=120)
    assert sent == [30 * 4, 40 * 4, 10 * 4, 20 * 4]  # rank r's peer on the other node: r ^ 2


def _on_nodes(rank, world, connections):
    comm = Communicator(None, config=dataclasses.replace(CONFIG, connections=connections))
    assert comm.hier is not None, comm.unavailable
    try:
        return _check_against_gloo(comm.hier, rank, world)
    finally:
        comm.close()


@pytest.mark.parametrize(
    "node_of",
    [
        (0, 0, 1, 1),  # 2 nodes x 2 ranks
        (0, 1, 0, 1),  # ranks of a node not consecutive: blocks regroup by local index
        (0, 1, 2),     # 3 nodes x 1 rank: no shared memory, three peers
        (0, 1),        # 2 nodes x 1 rank
    ],
)
def test_pipelined_reduce_scatter_and_allgather_match_gloo(node_of):
    run_ranks(_on_nodes, len(node_of), 1, rank_env=_nodes(*node_of), timeout=120)


def test_pipelined_reduce_scatter_and_allgather_match_gloo_over_two_connections():
    # The multi-connection transport's asynchronous reduce-scatter and allgather.
    run_ranks(_on_nodes, 4, 2, rank_env=_nodes(0, 0, 1, 1), timeout=120)


def _on_one_node(rank, world):
    # Every rank on one node: the inter-node group of each rank is itself alone.
    inter = [dist.new_group([r]) for r in range(world)][rank]
    shm = ShmComm(None, slot_bytes=4096, small_bytes=512, timeout=60)
    try:
        return _check_against_gloo(Hierarchical(Topology((0,) * world, rank), shm, inter), rank, world)
    finally:
        shm.close()


def test_pipelined_reduce_scatter_and_allgather_on_one_node_match_gloo():
    run_ranks(_on_one_node, 2, timeout=120)


def _inter_all_reduce(rank, world):
    """GlooInter's allreduce (a direct swap between two peers, gloo's own otherwise) equals
    gloo's, and every rank holds the same bits, signed zeros and NaN included."""
    inter = GlooInter(dist.new_group(list(range(world))))
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for op in (R.SUM, R.PRODUCT, R.MAX, R.MIN):
            for n in (0, 1, 1031):
                x = _data(rank, n + 7, n, dtype)
                ref = x.clone()
                dist.all_reduce(ref, op=op)
                handle = inter.all_reduce(x, op, async_op=True)
                handle.wait()
                assert torch.equal(x, ref), (dtype, op, n)
        if dtype.is_floating_point:
            special = torch.tensor([0.0, -0.0, float("nan"), 1.5, -2.0, float("inf")], dtype=dtype)
            for op in (R.SUM, R.PRODUCT, R.MAX, R.MIN):
                mine = special.roll(rank) * (-1) ** rank
                inter.all_reduce(mine, op)
                every = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(every, mine)
                bits = [t.view(torch.int16 if t.element_size() == 2 else torch.int32) for t in every]
                assert all(torch.equal(b, bits[0]) for b in bits), (dtype, op, every)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_inter_node_allreduce_matches_gloo_with_the_same_bits_on_every_peer(world):
    run_ranks(_inter_all_reduce, world, timeout=120)


def test_node_rows_are_views_when_evenly_spaced_and_an_index_otherwise():
    blocks = torch.arange(24.0).view(6, 4)
    for ranks in [(0, 1, 2), (1, 3, 5), (4,)]:
        rows = _rows(ranks)
        assert isinstance(rows, slice)
        view = _select(blocks, rows, slice(1, 3), fresh)
        assert view.data_ptr() == blocks[ranks[0], 1].data_ptr()
        assert torch.equal(view, blocks[list(ranks)][:, 1:3])
    rows = _rows((0, 1, 3))
    assert torch.equal(_select(blocks, rows, slice(1, 3), fresh), blocks[[0, 1, 3]][:, 1:3])


@pytest.mark.parametrize("n", [0, 1, 2, 7, 100, 1 << 20, (1 << 22) + 6, (1 << 22) + 7, 1 << 24])
def test_ramped_chunks_partition_the_buffer(n):
    step, unit = 1 << 20, 2
    bounds = _ramped(n, step, unit)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous
    assert (bounds[0][0], bounds[-1][1]) == (0, n) if n else bounds == []
    sizes = [hi - lo for lo, hi in bounds]
    assert all(0 < s < step + unit for s in sizes)
    assert all(s % unit == 0 for s in sizes[:-1])
    if n >= 4 * step:  # big buffers start and end small
        assert sizes[:2] == [step // 4, step // 2] and sizes[-2:] == [step // 2, step // 4 + n % unit]



def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def test_a_chunks_temporaries_are_kept_for_the_chunk_a_ring_later_and_never_overlap():
    """Scratch: pieces of one chunk, and of the chunks in flight, are apart; the chunk that
    takes a slot again gets the same memory (no new allocation); a piece over KEPT is new."""
    ring = Scratch(3)
    first = {}
    for k in range(9):
        ring.begin(k)
        pieces = [ring.take(k, 1000 + 7 * (k % 3), torch.float32), ring.take(k, 333, torch.bfloat16),
                  ring.take(k, 5, torch.int64)]
        assert [p.numel() for p in pieces] == [1000 + 7 * (k % 3), 333, 5] and all(p.is_contiguous() for p in pieces)
        assert all(p.data_ptr() % 64 == 0 for p in pieces)
        first.setdefault(k % 3, []).append(pieces)
    for calls in first.values():  # chunks k and k + 3 share a slot: once it has grown, the same memory
        assert [p.data_ptr() for p in calls[1]] == [p.data_ptr() for p in calls[2]]
    live = [p for calls in first.values() for p in calls[-1]]  # the last three chunks: in flight together
    spans = sorted(_span(p) for p in live)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    held = ring.held()
    big = ring.take(0, KEPT // 4 + 1, torch.float32)
    assert ring.held() == held and big.numel() == KEPT // 4 + 1


def test_every_slot_takes_the_largest_size_at_its_next_chunk_so_memory_held_stops_growing():
    """The largest chunk of a call falls on one slot, which one depending on the call's chunk
    count; the other slots take its size when their next chunk begins. So after the first
    largest chunk and one round of the ring, calls of any chunk count hold no more memory."""
    ring, k = Scratch(3), 0

    def call(sizes):  # one call's chunks, each taking a piece of ``size`` bytes
        nonlocal k
        for size in sizes:
            ring.begin(k)
            ring.take(k, size, torch.uint8)
            k += 1

    call([1000, 2000])
    assert ring.held() == 2 * (1 << 20)  # two slots used, one grain each
    call([3 << 20])  # the largest chunk so far, on slot 2
    assert ring.held() == 2 * (1 << 20) + (3 << 20)
    call([10, 10, 10])  # slots 0 and 1 take the largest size as they begin
    held = ring.held()
    assert held == 3 * (3 << 20)
    rng = random.Random(0)
    for _ in range(50):  # the largest chunk on every slot in turn: nothing more is mapped
        call([rng.randrange(1, 3 << 20) for _ in range(rng.randrange(1, 8))] + [3 << 20])
        assert ring.held() == held


def test_a_slot_grows_to_the_chunk_and_keeps_what_it_gave():
    ring = Scratch(1)
    ring.begin(0)
    small = ring.take(0, 16, torch.float32)
    small.fill_(3)
    large = ring.take(0, 1 << 20, torch.float32)  # past the arena: a bigger one, the first piece kept
    large.fill_(1)
    assert torch.equal(small, torch.full((16,), 3.0)) and ring.held() >= 4 << 20
    held = ring.held()
    ring.begin(0)  # the next chunk on this slot: the grown arena serves it whole
    ring.take(0, 16, torch.float32), ring.take(0, 1 << 20, torch.float32)
    assert ring.held() == held


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.AVG])
def test_fp16_rows_reduced_in_fp32_scratch_equal_torchs_reduction_and_allocate_nothing(dtype, op):
    """ops.reduce_rows given scratch: the bits of torch's fp32 reduction, with no row
    allocated (torch's makes an fp32 copy of every row: this fails on it)."""
    from torch.profiler import ProfilerActivity, profile

    from slipstream.core_comm.ops import reduce_rows

    rows = (torch.randn(4, 1 << 16, generator=torch.Generator().manual_seed(0)) * 2).to(dtype)
    want, got = torch.empty(1 << 16, dtype=dtype), torch.empty(1 << 16, dtype=dtype)
    reduce_rows(rows, want, op, 4)
    ring = Scratch(1)
    ring.begin(0)
    reduce_rows(rows, got, op, 4, ring.taker(0))  # the arena grows here
    ring.begin(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        reduce_rows(rows, got, op, 4, ring.taker(0))
    assert torch.equal(got, want)
    made = [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage >= 1024]  # AVG's scalar: 4 B
    assert not made, made


def test_after_a_failed_chunk_later_calls_take_new_arenas():
    """A failed chunk leaves the exchanges of the chunks after it in flight, still writing into
    their slots: the path's next call must not be given that memory."""
    path = Hierarchical.__new__(Hierarchical)
    path.depth, path.scratch = 2, Scratch(3)
    path._pipelined(iter(range(5)), lambda k: None)
    before = path.scratch

    def finish(k):
        if k == 1:
            raise RuntimeError("exchange with global rank(s) 2 on the other node(s) failed")

    with pytest.raises(RuntimeError, match="exchange"):
        path._pipelined(iter(range(5)), finish)
    assert path.scratch is not before
