"""The Megatron-core adapter: tensor- and data-parallel layers on slipstream against gloo, the
argument provider, and groups for users who keep another backend."""

from __future__ import annotations

import argparse
import pytest
import torch
import torch.distributed as dist

import slipstream  # noqa: F401 - registers the backend (the ranks import this module)
from _dist import from_bytes as _load, run_ranks, to_bytes as _bytes

pytest.importorskip("megatron.core")


def _tp_step(rank, world, tp, collection=False):
    """A column- then row-parallel MLP at TP=``tp`` (DP = world / tp), one backward, the
    gradients averaged over the data-parallel group."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.model_parallel_config import ModelParallelConfig

    from slipstream.core_comm import counters

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    groups = None
    if collection:
        from slipstream import megatron

        groups = megatron.process_groups()
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True)
    torch.manual_seed(0)
    init = lambda w: torch.nn.init.normal_(w, std=0.02)  # noqa: E731
    col = tensor_parallel.ColumnParallelLinear(64, 256, config=cfg, init_method=init, bias=True, gather_output=False)
    row = tensor_parallel.RowParallelLinear(256, 64, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                                            skip_bias_add=False)
    dp = parallel_state.get_data_parallel_group()
    x = torch.randn(8, 4, 64, generator=torch.Generator().manual_seed(1 + parallel_state.get_data_parallel_rank()))
    counters.reset()
    h, _ = col(x)
    y, _ = row(torch.nn.functional.gelu(h))
    y.pow(2).mean().backward()
    grads = [p.grad for p in (*col.parameters(), *row.parameters())]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=dp)  # DP: what Megatron's DDP does with its bucket
    out = {"y": y.detach(), "grads": flat / dist.get_world_size(dp), "counts": counters.snapshot(),
           "tp_backend": dist.get_backend_config(parallel_state.get_tensor_model_parallel_group())}
    if collection:
        from slipstream import megatron

        out["collection_tp"] = dist.get_backend_config(groups.tp)
        megatron.restore_process_groups()
        out["restored_tp"] = dist.get_backend_config(parallel_state.get_tensor_model_parallel_group())
    parallel_state.destroy_model_parallel()
    return _bytes(out)


@pytest.mark.parametrize("world, tp, nodes", [(2, 2, (0, 0)), (4, 2, (0, 0, 0, 0)), (4, 2, (0, 0, 1, 1)),
                                              (4, 1, (0, 0, 1, 1))],
                         ids=["tp2", "tp2xdp2", "tp2xdp2-two-nodes", "dp4-two-nodes"])
def test_tensor_and_data_parallel_layers_on_slipstream_equal_gloo(world, tp, nodes):
    env = [{"SLIPSTREAM_NODE": str(n)} for n in nodes]
    stock = _load(run_ranks(_tp_step, world, tp, rank_env=env, timeout=300))
    ours = _load(run_ranks(_tp_step, world, tp, rank_env=env, backend="slipstream", timeout=300))
    for s, o in zip(stock, ours):
        assert torch.equal(o["y"], s["y"])  # TP sums of two partials: one order, bit-equal
        torch.testing.assert_close(o["grads"], s["grads"], rtol=1e-6, atol=1e-9)  # DP over 2 nodes: another order
        assert "slipstream" in o["tp_backend"], o
        paths = set(o["counts"]["all_reduce"])
        assert paths & {"shm", "cma", "hierarchical"}, o["counts"]
        if world > tp:  # with TP=world the data-parallel group has one rank: nothing to reduce
            assert "stock" not in paths, o["counts"]


def test_process_groups_gives_slipstream_twins_to_a_job_on_gloo_and_restores_parallel_state():
    env = [{"SLIPSTREAM_NODE": "0"}] * 2
    stock = _load(run_ranks(_tp_step, 2, 2, rank_env=env, timeout=300))
    ours = _load(run_ranks(_tp_step, 2, 2, True, rank_env=env, timeout=300))  # default group on gloo
    for s, o in zip(stock, ours):
        assert torch.equal(o["y"], s["y"])
        assert "slipstream" in o["tp_backend"] and "slipstream" in o["collection_tp"]  # the getters answer twins
        assert "slipstream" not in o["restored_tp"]
        assert set(o["counts"]["all_reduce"]) & {"shm", "cma"}, o["counts"]


def test_the_argument_provider_parses_chains_and_refuses_bad_values(tmp_path):
    from slipstream import megatron

    def users_own(parser):
        parser.add_argument("--my-flag", type=int, default=3)
        return parser

    parser = megatron.chain(users_own, megatron.add_arguments)(argparse.ArgumentParser())
    args = parser.parse_args(["--slipstream", "--my-flag", "5"])
    assert args.slipstream and args.my_flag == 5 and args.slipstream_config is None
    assert "--slipstream-config" in parser.format_help()
    bad = tmp_path / "s.json"
    bad.write_text('{"comm": {"chunkbytes": 1}}')
    with pytest.raises(ValueError, match=r"--slipstream-config: .*s.json: slipstream.comm: unknown key 'chunkbytes'"):
        megatron.initialize(parser.parse_args(["--slipstream", "--slipstream-config", str(bad)]))
    with pytest.raises(ValueError, match="--slipstream-config needs --slipstream"):
        megatron.initialize(parser.parse_args(["--slipstream-config", str(bad)]))
    args = argparse.Namespace(slipstream=True, slipstream_config=None, distributed_backend="nccl")
    try:
        assert megatron.initialize(args) and args.distributed_backend == "cpu:slipstream,cuda:nccl"
    finally:
        slipstream.disable()
