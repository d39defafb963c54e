"""CUDA tensors through CPU-Reduce, staged through pinned host memory (GPU machines only)."""

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from slipstream.core_comm import CommConfig, Communicator

pytestmark = pytest.mark.gpu


def _staged(rank, world):
    # The test ranks share one GPU; gloo carries CUDA tensors, so the communicator stages.
    comm = Communicator(None, config=CommConfig(chunk_bytes=1 << 16, slot_bytes=1 << 14, small_bytes=1024))
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 1031, 300_007):  # one chunk, several chunks, many chunks with a tail
            g = torch.Generator().manual_seed(rank * 10 + n)
            host = torch.randn(n, generator=g).to(dtype)
            ref = host.clone()
            dist.all_reduce(ref)
            x = host.cuda()
            assert comm.algorithm(x)[0] == "staged"
            comm.all_reduce(x)
            tol = 5e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(x.cpu().double(), ref.double(), rtol=tol, atol=tol)
        full = torch.arange(world * 8, dtype=dtype).cuda() + rank
        out = torch.empty(8, dtype=dtype, device="cuda")
        comm.reduce_scatter(out, full)
        expected = (torch.arange(world * 8, dtype=torch.float64).view(world, 8)[rank] * world
                    + sum(range(world)))
        torch.testing.assert_close(out.cpu().double(), expected)
        gathered = torch.empty(world * 4, dtype=dtype, device="cuda")
        comm.all_gather(gathered, torch.full((4,), float(rank), dtype=dtype, device="cuda"))
        assert torch.equal(gathered.cpu().view(world, 4)[:, 0], torch.arange(world, dtype=dtype))
    comm.close()
    return True


def test_cuda_tensors_are_staged_through_pinned_memory_and_match_gloo():
    run_ranks(_staged, 2, rank_env=[{"SLIPSTREAM_NODE": "0"}] * 2, timeout=300)
