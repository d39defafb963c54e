"""CPU-Reduce through shared memory against gloo on the same ranks."""

import os
import signal

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from slipstream.core_comm.collectives.shm import ShmComm, ShmError

R = dist.ReduceOp
OPS = [R.SUM, R.AVG, R.MAX, R.MIN, R.PRODUCT]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8]
# Small slots so that a few thousand elements already take several pipelined chunks.
SLOT, SMALL = 4096, 512
SIZES = [0, 1, 7, 127, 1031, 5003]


def _data(rank, case, n, dtype, op):
    g = torch.Generator().manual_seed(1000 * case + rank)
    if dtype.is_floating_point:
        if op == R.PRODUCT:
            return (0.5 + torch.rand(n, generator=g)).to(dtype)
        return torch.randn(n, generator=g).to(dtype)
    hi = 3 if op == R.PRODUCT else 100
    return torch.randint(0, hi, (n,), generator=g).to(dtype)


def _close(actual, expected, dtype):
    if dtype.is_floating_point:
        tol = {torch.float16: 2e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-5)
        torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)
    else:
        assert torch.equal(actual, expected)


def _matrix(rank, world):
    comm = ShmComm(None, slot_bytes=SLOT, small_bytes=SMALL, timeout=60)
    case = 0
    for dtype in DTYPES:
        for op in OPS:
            if op == R.AVG and not dtype.is_floating_point:
                continue
            for n in SIZES:
                case += 1
                x = _data(rank, case, n, dtype, op)
                ref = x.clone()
                gloo_op = R.SUM if op == R.AVG else op
                dist.all_reduce(ref if dtype not in (torch.float16, torch.bfloat16) else ref, op=gloo_op)
                if op == R.AVG:
                    ref = (ref.double() / world).to(dtype) if dtype.is_floating_point else ref
                got = x.clone()
                comm.all_reduce(got, op)
                _close(got, ref, dtype)
                # reduce-scatter of world x n, allgather of n
                full = _data(rank, case + 7, n * world, dtype, op)
                rs_ref = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(rs_ref, full.clone(), op=gloo_op)
                if op == R.AVG:
                    rs_ref = (rs_ref.double() / world).to(dtype)
                rs = torch.empty(n, dtype=dtype)
                comm.reduce_scatter(rs, full, op)
                _close(rs, rs_ref, dtype)
            ag_ref = torch.empty(1031 * world, dtype=dtype)
            piece = _data(rank, case, 1031, dtype, R.SUM)
            dist.all_gather_into_tensor(ag_ref, piece)
            ag = torch.empty_like(ag_ref)
            comm.all_gather(ag, piece)
            assert torch.equal(ag, ag_ref)
    comm.close()
    return case


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shm_collectives_match_gloo_for_every_op_dtype_and_size(world):
    cases = run_ranks(_matrix, world, timeout=300)
    assert all(c == cases[0] and c > 100 for c in cases)


def _default_sizes_and_layouts(rank, world):
    comm = ShmComm(None, timeout=60)  # default slots: 1 MiB, small path up to 64 KiB
    for n in [16 * 1024 - 1, 300_007]:  # small path; several 1 MiB chunks, prime length
        x = _data(rank, n, n, torch.float32, R.SUM)
        ref = x.clone()
        dist.all_reduce(ref)
        comm.all_reduce(x)
        _close(x, ref, torch.float32)
    # Non-contiguous input keeps its strides and gets the right values.
    base = _data(rank, 3, 64 * 50, torch.float32, R.SUM).view(64, 50)
    view = base[:, ::3]
    ref = view.clone()
    dist.all_reduce(ref)
    comm.all_reduce(view)
    _close(view, ref, torch.float32)
    # FSDP2-style allgather: the input is this rank's row of the output.
    out = torch.zeros(world * 1000)
    out.view(world, 1000)[rank] = rank + 1
    comm.all_gather(out, out.view(world, 1000)[rank])
    assert torch.equal(out.view(world, 1000)[:, 0], torch.arange(1, world + 1, dtype=torch.float32))
    # Non-contiguous output of reduce-scatter.
    full = torch.ones(world * 10)
    holder = torch.zeros(10, 2)
    comm.reduce_scatter(holder[:, 0], full)
    assert torch.equal(holder[:, 0], torch.full((10,), float(world)))
    assert torch.equal(holder[:, 1], torch.zeros(10))
    comm.close()
    return True


def test_shm_handles_large_prime_noncontiguous_and_aliased_inputs():
    run_ranks(_default_sizes_and_layouts, 4, timeout=180)


def _mismatched_sizes(rank, world):
    comm = ShmComm(None, timeout=30)
    try:
        comm.all_reduce(torch.ones(10 + rank))
    except ShmError as e:
        return str(e)
    return "no error"


def test_shm_reports_tensors_of_different_sizes_across_ranks():
    msgs = run_ranks(_mismatched_sizes, 2, timeout=120)
    for m in msgs:
        assert "differs between ranks" in m and "10" in m and "11" in m


def _killed_rank(rank, world):
    comm = ShmComm(None, timeout=60)
    comm.all_reduce(torch.ones(100))
    name = comm.segment_name
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.all_reduce(torch.ones(1 << 20))
    except ShmError as e:
        return name, str(e)
    return name, "no error"


def test_surviving_ranks_raise_and_no_segment_remains_after_sigkill():
    results = run_ranks(_killed_rank, 3, timeout=120, allow_failures=True)
    assert isinstance(results[1], Exception)  # the killed rank reported nothing
    for r in (0, 2):
        name, msg = results[r]
        assert "died" in msg and "local rank 1" in msg
        assert not os.path.exists(name)


def _segment_is_private(rank, world):
    comm = ShmComm(None)
    exists = os.path.exists(comm.segment_name)
    comm.close()
    return comm.segment_name, exists


def test_segment_name_is_unguessable_and_unlinked_after_setup():
    (n0, e0), (n1, e1) = run_ranks(_segment_is_private, 2)
    assert n0 == n1 and not e0 and not e1
    assert len(os.path.basename(n0)) >= len("slipstream-") + 32


def test_rejects_unsupported_input_with_a_reason():
    assert "dtype" in ShmComm.supports(torch.ones(2, dtype=torch.complex64))
    assert "AVG" in ShmComm.supports(torch.ones(2, dtype=torch.int32), R.AVG)
    assert ShmComm.supports(torch.ones(2)) is None
