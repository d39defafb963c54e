"""Plain DistributedDataParallel on the ``slipstream`` backend, and ``slipstream.ddp_hook`` on a
gloo group, against DDP on gloo: the same weights after a few SGD steps (fp32 tolerance: the
core sums in another order than gloo's ring)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

import slipstream
from _dist import run_ranks
from slipstream.bench.workers.ddp import batch, make_model
from slipstream.core_comm import counters
from slipstream.core_comm.backend.process_group import SlipstreamProcessGroup

TWO_NODES = [{"SLIPSTREAM_NODE": str(r // 2)} for r in range(4)]
WIDTH, DEPTH, STEPS = 256, 2, 4  # 132 k parameters: several 0.25 MB buckets, each past the latency path


def _train(rank: int, hook=None, state=None) -> torch.Tensor:
    model = DDP(make_model(WIDTH, DEPTH), bucket_cap_mb=0.25)
    if hook is not None:
        model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        x, y = batch(rank, step, 8, WIDTH)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])


def _weights(rank: int, world: int) -> bytes:
    counters.reset()
    out = {"plain": _train(rank), "counts": counters.snapshot()}
    if not isinstance(dist.group.WORLD, SlipstreamProcessGroup):
        out["hook"] = _train(rank, slipstream.ddp_hook)
        out["hook_state"] = _train(rank, slipstream.ddp_hook, slipstream.DDPHookState(dist.group.WORLD))
    else:
        out["algorithm"] = dist.group.WORLD.communicator.algorithm(torch.empty(1 << 16))[0]
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _run(backend: str, rank_env) -> list[dict]:
    raw = run_ranks(_weights, 4, backend=backend, rank_env=rank_env, timeout=240, pg_timeout=120)
    return [torch.load(io.BytesIO(b)) for b in raw]


@pytest.mark.parametrize("layout", ["1x4", "2x2"])
def test_ddp_on_slipstream_and_with_hook_match_gloo(layout):
    rank_env = TWO_NODES if layout == "2x2" else None
    stock, ours = _run("gloo", rank_env), _run("slipstream", rank_env)
    for rank in range(4):
        reference = stock[rank]["plain"]
        assert_close(ours[rank]["plain"], reference, msg=lambda m: f"rank {rank} slipstream backend: {m}")
        assert_close(stock[rank]["hook"], reference, msg=lambda m: f"rank {rank} ddp_hook: {m}")
        assert_close(stock[rank]["hook_state"], reference, msg=lambda m: f"rank {rank} DDPHookState: {m}")
        assert ours[rank]["algorithm"] == ("hierarchical" if layout == "2x2" else "shm")
        # every bucket of every step through the core (DDP's first-iteration rebuild included)
        paths = ours[rank]["counts"]["all_reduce"]
        assert set(paths) <= {"shm", "cma", "hierarchical"} and sum(p["calls"] for p in paths.values()) >= STEPS
        assert stock[rank]["counts"].get("all_reduce", {}).keys() <= {"shm", "cma", "hierarchical"}
    assert_close(ours[0]["plain"], ours[3]["plain"], rtol=0, atol=0)  # replicas stay identical


def test_hook_state_rejects_a_bad_config():
    with pytest.raises(ValueError, match="CommConfig"):
        slipstream.DDPHookState(config={"shm": False})


@pytest.mark.gpu
def test_ddp_on_slipstream_with_cuda_tensors_uses_nccl():
    # One process, one rank: the group's CUDA backend must be NCCL and DDP must train.
    store = dist.HashStore()
    dist.init_process_group("slipstream", store=store, rank=0, world_size=1)
    try:
        pg = dist.group.WORLD
        assert pg._get_backend(torch.device("cuda")).name() == "nccl"
        model = DDP(make_model(64, 1).cuda(), device_ids=[0])
        model(torch.randn(4, 64, device="cuda")).sum().backward()
    finally:
        dist.destroy_process_group()


def test_bench_ddp_says_where_the_step_goes(tmp_path):
    """``slipstream bench ddp`` on one node of 2: equal weights to gloo's, a compute-alone step,
    slipstream's time in collectives from the core's timeline, each backend's exposed part."""
    import json

    from slipstream.cli import main

    figures = tmp_path / "records.json"
    assert main(["bench", "ddp", "--layouts", "1x2", "--width", "64", "--depth", "2", "--steps", "3",
                 "--warmup", "1", "--json", str(figures)]) == 0
    (record,) = json.loads(figures.read_text())
    assert record["weights_allclose"]
    assert 0 < record["compute_s"] and 0 < record["comm_s"] <= record["step_s"]["slipstream"]
    for backend in ("gloo", "slipstream"):
        assert record["exposed_s"][backend] == max(0.0, record["step_s"][backend] - record["compute_s"])
    assert record["link_bound_s"] is None and record["sent_bound_s"] is None  # one node: no link
