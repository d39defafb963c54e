"""The stream-race probe of ``slipstream bench gpu`` as tests (GPU machines only): waiting on
what each async entry point returns makes the waiting stream wait for the collective's data.

Each wrapper's call is issued on a side stream held back by ``torch.cuda._sleep`` and waited as
its consumer waits; its outputs, pre-filled with NaN, are copied at once on the waiting stream
(``slipstream/bench/workers/gpu_probe.py``). The stock handle without a wait is the control: it
must race, or the probe proves nothing on this machine.
"""

import pytest
import torch

from _dist import run_ranks

pytestmark = pytest.mark.gpu


def _assert_no_race(results: list[dict], where: str) -> None:
    controls = [r for r in results if "without a wait" in r["name"]]
    assert controls and all(r["race"] for r in controls), f"{where}: the control without a wait did not race: " \
                                                          f"{controls}"
    bad = [r for r in results if r not in controls
           and (r["race"] or r["result"].startswith(("FAILED", "wrong", "race")))]
    assert not bad, f"{where}:\n" + "\n".join(f"  {r['name']}: {r['result']}" for r in bad)


def _one_rank(rank, world):
    from slipstream.bench.workers.gpu_probe import one_rank

    return one_rank(torch.device("cuda", 0))


def test_no_async_wrapper_races_on_a_one_rank_nccl_group():
    """The slipstream backend (plain, coalesced), the pool, FSDP2's all-gather, DeepSpeed's
    stand-in and the DDP hook on a 1-rank group whose CUDA backend is NCCL."""
    (results,) = run_ranks(_one_rank, 1, init_group=False, timeout=240)
    _assert_no_race(results, "1 rank, NCCL")
    assert any(r["name"].startswith("DeepSpeed") for r in results)  # probed, or skipped saying why


def _staged(rank, world):
    from slipstream.bench.workers.gpu_probe import probe_all

    torch.cuda.set_device(0)
    return probe_all(None, torch.device("cuda", 0))


def test_no_async_wrapper_races_on_the_staged_path_of_ranks_sharing_a_gpu():
    """Two ranks on one GPU over gloo: the core stages CUDA tensors through pinned host memory."""
    for rank, results in enumerate(run_ranks(_staged, 2, rank_env=[{"SLIPSTREAM_NODE": "0"}] * 2, timeout=240)):
        _assert_no_race(results, f"rank {rank}, gloo with CUDA tensors")


def _nccl(rank, world):
    import torch.distributed as dist

    import slipstream  # noqa: F401 - registers the slipstream backend
    from slipstream.bench.workers.gpu_probe import probe_all

    torch.cuda.set_device(rank)
    slip = dist.new_group(backend="slipstream")
    return probe_all(None, torch.device("cuda", rank), slip)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL takes one GPU per rank")
def test_no_async_wrapper_races_on_a_two_rank_nccl_group():
    for rank, results in enumerate(run_ranks(_nccl, 2, backend="nccl", timeout=240)):
        _assert_no_race(results, f"rank {rank}, NCCL")
