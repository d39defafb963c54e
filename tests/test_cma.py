"""In-place collectives through cross-memory attach against gloo on the same ranks."""

import ctypes
import errno
import logging

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from slipstream.core_comm.collectives import cma
from slipstream.core_comm.routing import CMA_FROM_BYTES
from slipstream.core_comm.compat import all_gather_into_tensor, reduce_scatter_tensor
from slipstream.core_comm.collectives.cma import CmaComm
from slipstream.core_comm.collectives.shm import ShmComm, ShmError

R = dist.ReduceOp
OPS = [R.SUM, R.AVG, R.MAX, R.MIN, R.PRODUCT]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]
CHUNK = 4096  # small chunks: a few thousand elements already take several
SIZES = [0, 1, 1031, 20_011]  # 20_011 (prime): uneven slices, several chunks each


def _data(rank, case, n, dtype, op):
    g = torch.Generator().manual_seed(1000 * case + rank)
    if dtype.is_floating_point:
        if op == R.PRODUCT:
            return (0.5 + torch.rand(n, generator=g)).to(dtype)
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 3 if op == R.PRODUCT else 100, (n,), generator=g).to(dtype)


def _gloo(x, op, world, kind="all_reduce"):
    """gloo's result, AVG computed as SUM / world in float64."""
    gloo_op = R.SUM if op == R.AVG else op
    if kind == "all_reduce":
        out = x.clone()
        dist.all_reduce(out, op=gloo_op)
    else:
        out = torch.empty(x.numel() // world, dtype=x.dtype)
        reduce_scatter_tensor(out, x.clone(), op=gloo_op)
    return (out.double() / world).to(x.dtype) if op == R.AVG else out


def _close(actual, expected):
    if actual.dtype.is_floating_point:
        tol = {torch.float16: 2e-2, torch.bfloat16: 5e-2}.get(actual.dtype, 1e-5)
        torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)
    else:
        assert torch.equal(actual, expected)


def _same_on_every_rank(t, world):
    every = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(every, t.contiguous())
    assert all(torch.equal(e, t) for e in every)


def _matrix(rank, world):
    comm = CmaComm(ShmComm(None, timeout=60), chunk_bytes=CHUNK)
    case = 0
    for dtype in DTYPES:
        for op in OPS:
            if op == R.AVG and not dtype.is_floating_point:
                continue
            for n in SIZES:
                case += 1
                # allreduce in place on a view at an offset into a bigger storage
                storage = _data(rank, case, n + 13, dtype, op)
                before = storage.clone()
                x = storage[5:5 + n]
                ref = _gloo(x, op, world)
                comm.all_reduce(x, op)
                _close(x, ref)
                _same_on_every_rank(x, world)
                assert torch.equal(storage[:5], before[:5]) and torch.equal(storage[5 + n:], before[5 + n:])
                full = _data(rank, case + 7, n * world, dtype, op)
                rs = torch.empty(n, dtype=dtype)
                comm.reduce_scatter(rs, full, op)
                _close(rs, _gloo(full, op, world, "reduce_scatter"))
            piece = _data(rank, case, 1031, dtype, R.SUM)
            ag_ref = torch.empty(1031 * world, dtype=dtype)
            all_gather_into_tensor(ag_ref, piece)
            ag = torch.empty_like(ag_ref)
            comm.all_gather(ag, piece)
            assert torch.equal(ag, ag_ref)
    return case


@pytest.mark.parametrize("world", [2, 3, 4])
def test_cma_collectives_match_gloo_for_every_op_dtype_and_size(world):
    cases = run_ranks(_matrix, world, timeout=180)
    assert all(c == cases[0] and c > 50 for c in cases)


def _layouts(rank, world):
    comm = CmaComm(ShmComm(None, timeout=60), chunk_bytes=CHUNK)
    # Non-contiguous allreduce: the strided elements change, the others do not.
    base = _data(rank, 3, 64 * 50, torch.float32, R.SUM).view(64, 50)
    view, before = base[:, ::3], base.clone()
    ref = _gloo(view.contiguous(), R.SUM, world)
    comm.all_reduce(view)
    _close(view, ref)
    mask = torch.ones(64, 50, dtype=torch.bool)
    mask[:, ::3] = False
    assert torch.equal(base[mask], before[mask])
    # FSDP2-style allgather: the input is this rank's row of the output.
    out = torch.zeros(world * 5000)
    rows = out.view(world, 5000)
    rows[rank] = torch.arange(5000) + rank
    comm.all_gather(out, rows[rank])
    assert torch.equal(rows, torch.arange(5000) + torch.arange(world)[:, None].float())
    # Input that is another rank's row of the output: still the right answer.
    out = torch.zeros(world * 700)
    other = out.view(world, 700)[(rank + 1) % world]
    other.fill_(rank)
    comm.all_gather(out, other)
    assert torch.equal(out.view(world, 700), torch.arange(world)[:, None].float().expand(world, 700))
    # Reduce-scatter into this rank's own block of the input, and into a strided output.
    full = torch.ones(world * 3000)
    mine = full.view(world, 3000)[rank]
    comm.reduce_scatter(mine, full)
    assert torch.equal(mine, torch.full((3000,), float(world)))
    holder = torch.zeros(3000, 2)
    comm.reduce_scatter(holder[:, 0], torch.ones(world * 3000))
    assert torch.equal(holder[:, 0], torch.full((3000,), float(world)))
    assert torch.equal(holder[:, 1], torch.zeros(3000))
    return True


def test_cma_handles_offsets_strides_and_aliased_inputs():
    run_ranks(_layouts, 3, timeout=120)


def _half_sums(rank, world):
    """fp16/bf16 sums over 3 ranks: the bits of an fp32 sum in the order the ranks combine
    their peers, with no fp32 copy made per chunk (torch's mixed-dtype add makes one each time)."""
    from torch.profiler import ProfilerActivity, profile

    comm = CmaComm(ShmComm(None, timeout=60), chunk_bytes=CHUNK)
    made = []
    for case, dtype in enumerate((torch.float16, torch.bfloat16)):
        mine = _data(rank, 50 + case, 20_011, dtype, R.SUM)
        every = torch.empty(world * mine.numel(), dtype=dtype)
        all_gather_into_tensor(every, mine)
        rows = every.view(world, -1)
        x = mine.clone()
        comm.all_reduce(x)  # warm: the first call may set up what the path keeps
        x = mine.clone()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            comm.all_reduce(x)
        made += [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage >= 1024]
        bounds = cma._split(mine.numel(), world, max(1, 4096 // mine.element_size()))
        want = torch.empty_like(mine)
        for r in range(world):  # rank r reduces slice r: its own first, then r+1, r+2, ...
            a, b = bounds[r], bounds[r + 1]
            acc = rows[r, a:b].float()
            for k in range(1, world):
                acc = acc + rows[(r + k) % world, a:b].float()
            want[a:b] = acc.to(dtype)
        assert torch.equal(x, want), dtype
    assert not made, made
    return True


def test_cma_fp16_sums_are_exact_fp32_sums_made_in_kept_rows():
    assert all(run_ranks(_half_sums, 3, timeout=120))


def _communicator(rank, world, enabled, refuse_on):
    from slipstream.core_comm import CommConfig, Communicator

    if rank in refuse_on:
        cma._readv = _refuse
    logged, took = [], []
    log = logging.getLogger("slipstream.comm")
    log.setLevel(logging.DEBUG)
    log.addHandler(handler := logging.Handler())
    handler.emit = lambda record: logged.append(record.getMessage())
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        original = getattr(CmaComm, kind)
        setattr(CmaComm, kind, lambda self, *a, _f=original, _k=kind: (took.append(_k), _f(self, *a))[1])
    comm = Communicator(config=CommConfig(cma=enabled, timeout_s=60))
    for n in [1000, CMA_FROM_BYTES["all_gather"] // (4 * world) + 7]:  # below and above every threshold
        x = _data(rank, n, n, torch.float32, R.SUM)
        ref = _gloo(x, R.SUM, world)
        comm.all_reduce(x)
        _close(x, ref)
        full = _data(rank, n + 1, n * world, torch.float32, R.SUM)
        rs = torch.empty(n)
        comm.reduce_scatter(rs, full)
        _close(rs, _gloo(full, R.SUM, world, "reduce_scatter"))
        ag, ag_ref = torch.empty(n * world), torch.empty(n * world)
        all_gather_into_tensor(ag_ref, x)
        comm.all_gather(ag, x)
        assert torch.equal(ag, ag_ref)
    comm.close()
    return took, any("cross-memory" in m and "Operation not permitted" in m for m in logged)


def _refuse(*args):
    ctypes.set_errno(errno.EPERM)
    return -1


@pytest.mark.parametrize("enabled, refuse_on, uses_cma", [
    (True, (), True),
    (False, (), False),  # SLIPSTREAM_CMA=0
    (True, (1,), False),  # one rank refused: every rank keeps the shared-memory path
])
def test_communicator_takes_cma_for_large_messages_only_where_every_rank_can(enabled, refuse_on, uses_cma):
    took = ["all_reduce", "reduce_scatter", "all_gather"] if uses_cma else []  # only the large ones
    refused = bool(refuse_on)  # then every rank logs why, at debug level
    assert run_ranks(_communicator, 3, enabled, refuse_on, timeout=120) == [(took, refused)] * 3


def _probe_refused(rank, world):
    cma._readv = _refuse
    try:
        CmaComm(ShmComm(None, timeout=60))
    except ShmError as e:
        return str(e)
    return "no error"


def test_probe_failure_names_the_ranks_and_the_reason():
    for msg in run_ranks(_probe_refused, 2, timeout=60):
        assert "not usable" in msg and "local rank" in msg and "Operation not permitted" in msg


def _peer_fails_mid_call(rank, world):
    comm = CmaComm(ShmComm(None, timeout=60), chunk_bytes=CHUNK)
    comm.all_reduce(torch.ones(10_000))
    if rank == 1:
        cma._writev = lambda *args: (ctypes.set_errno(errno.ESRCH), -1)[1]
    try:
        comm.all_reduce(torch.ones(10_000))
    except ShmError as e:
        msg = str(e)
    else:
        msg = "no error"
    try:
        comm.all_reduce(torch.ones(10_000))  # a failed communicator stays failed
    except ShmError as e:
        return msg, str(e)
    return msg, "no error"


def test_a_failing_rank_makes_every_rank_raise_instead_of_hanging():
    (m0, again0), (m1, again1), (m2, again2) = run_ranks(_peer_fails_mid_call, 3, timeout=60)
    assert "local rank 2" in m1 and "No such process" in m1  # rank 1 writes to rank 2 first
    assert "local rank 1 (global rank 1) failed" in m0 and "local rank 1 (global rank 1) failed" in m2
    assert all("unusable" in m for m in (again0, again1, again2))


def _mixed_paths(rank, world):
    shm = ShmComm(None, timeout=60)
    comm = CmaComm(shm)
    x = torch.ones(1 << 20)
    try:
        (comm if rank == 0 else shm).all_reduce(x)
    except ShmError as e:
        return str(e)
    return "no error"


def test_ranks_on_different_paths_raise_instead_of_mixing_results():
    for msg in run_ranks(_mixed_paths, 2, timeout=60):
        assert "differs between ranks" in msg and "cma_all_reduce" in msg
