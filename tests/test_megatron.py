"""The Megatron-core adapter: tensor- and data-parallel layers on slipstream against gloo, the
argument provider, groups for users who keep another backend, packed (THD) sequences on the
local attention against the padded GPT, and ``slipstream bench megatron``."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import pytest
import torch
import torch.distributed as dist

import slipstream  # registers the backend (the ranks import this module)
from slipstream._status import line as status_line
from _dist import from_bytes as _load, run_ranks, to_bytes as _bytes
from _megatron_optimizer import train as _optimizer_train

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
        # the data-parallel pairs of TP=2 on 2 nodes hold one rank per node: calls this small take
        # gloo's own exchange (routing.ONE_PER_NODE_STOCK_BELOW_BYTES)
        one_per_node = 1 < tp < world and len(set(nodes)) > 1
        if world > tp:  # with TP=world the data-parallel group has one rank: nothing to reduce
            assert ("stock" in paths) == one_per_node, o["counts"]


@pytest.mark.parametrize("distributed", [False, True], ids=["ddp", "distributed-optimizer"])
def test_megatron_optimizer_at_tp2xdp2_on_slipstream_equals_gloo_through_the_fast_path(distributed):
    """A GPT at TP=2 x DP=2 on one node, trained by Megatron's DDP and ``get_megatron_optimizer``
    (on CPU through the tests' ``CudaOnCpu``): with the distributed optimizer the gradients are
    reduce-scattered and the parameters all-gathered, in torch's coalescing manager."""
    env = [{"SLIPSTREAM_NODE": "0"}] * 4
    stock = _load(run_ranks(_optimizer_train, 4, 2, distributed, rank_env=env, timeout=300))
    ours = _load(run_ranks(_optimizer_train, 4, 2, distributed, rank_env=env, backend="slipstream", timeout=300))
    coalesced = ("reduce_scatter_coalesced", "all_gather_coalesced") if distributed else ("all_reduce_coalesced",)
    for s, o in zip(stock, ours):
        if distributed:  # it sums the grad norm over all 4 ranks: the order may round the last bit apart
            torch.testing.assert_close(o["losses"], s["losses"], rtol=1e-6, atol=0)
            torch.testing.assert_close(o["params"], s["params"], rtol=1e-5, atol=1e-7)
        else:  # every sum is over two ranks (TP, DP, the norm over TP): one order, bit-equal
            assert torch.equal(o["losses"], s["losses"]) and torch.equal(o["params"], s["params"])
        assert o["losses"][-1] < o["losses"][0], o["losses"]  # the optimizer stepped
        assert s["counts"] == {}, s["counts"]  # gloo's calls do not reach slipstream
        for kind in ("all_reduce", *coalesced):
            paths = set(o["counts"].get(kind, {}))
            assert paths and paths <= {"shm", "cma"}, (kind, o["counts"])
        assert distributed == ("reduce_scatter_coalesced" in o["counts"]), o["counts"]


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
    # --slipstream-varlen alone: the local attention takes packed sequences, no collective changes
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    stock = DotProductAttention.forward
    assert "--slipstream-varlen" in parser.format_help()
    try:
        assert not megatron.initialize(parser.parse_args(["--slipstream-varlen"]))
        assert DotProductAttention.forward is not stock and "packed (THD)" in status_line()
    finally:
        megatron.disable_packed_attention()
    assert DotProductAttention.forward is stock
    # --slipstream-compile alone: Megatron's DDP compiles what it wraps; collectives unchanged
    from megatron.core.distributed import DistributedDataParallel

    init = DistributedDataParallel.__init__
    bad.write_text('{"compile": {"budget": 5}}')
    with pytest.raises(ValueError, match=r"--slipstream-config: .*s.json: slipstream.compile: unknown key 'budget'"):
        megatron.initialize(parser.parse_args(["--slipstream-compile", "--slipstream-config", str(bad)]))
    try:
        assert not megatron.initialize(parser.parse_args(["--slipstream-compile"]))
        assert DistributedDataParallel.__init__ is not init and not slipstream.is_enabled()
        megatron.enable_compile()  # again: one patch
        megatron.disable_compile()
        assert DistributedDataParallel.__init__ is init
    finally:
        megatron.disable_compile()


def test_the_search_counts_an_iterations_micro_batches():
    """Megatron's DDP module is called once per micro-batch: ``--train-iters`` (or the samples
    over the global batch) times the micro-batches of Megatron's calculator (global batch /
    (micro-batch x data-parallel))."""
    from megatron.core import num_microbatches_calculator as calculator

    from slipstream.plugins.megatron.adapter import micro_batches

    from slipstream.plugins.megatron.adapter import train_iterations

    assert train_iterations(argparse.Namespace(train_iters=7, train_samples=None, global_batch_size=16)) == 7
    assert train_iterations(argparse.Namespace(train_iters=None, train_samples=100, global_batch_size=16)) == 6
    assert train_iterations(argparse.Namespace(slipstream_compile=True)) is None
    assert micro_batches() == 1  # megatron-core without Megatron-LM's set-up
    calculator.init_num_microbatches_calculator(rank=0, rampup_batch_size=None, global_batch_size=16,
                                                micro_batch_size=2, data_parallel_size=2)
    try:
        assert micro_batches() == 4
        assert slipstream.CompileConfig().with_run_length(5, micro_batches()).expected_steps == 20
    finally:
        calculator.destroy_num_microbatches_calculator()


@pytest.mark.slow
def test_megatron_ddp_with_slipstream_compile_trains_as_eager_with_the_ranks_agreeing():
    """``--slipstream-compile`` in a job on Megatron's DDP and optimizer (TP=1 x DP=2): the
    search measures inductor on the first steps, both ranks choose alike, and the losses and
    parameters are eager's up to float32 rounding (inductor reorders sums; Adam carries the
    difference into the parameters, measured ~2e-5 of 1.0 after 4 steps)."""
    env = [{"SLIPSTREAM_NODE": "0"}] * 2
    flags = ["--slipstream-compile", "--slipstream-config", None]
    with tempfile.TemporaryDirectory() as d:
        flags[2] = os.path.join(d, "s.json")
        with open(flags[2], "w") as f:  # one candidate, one timed step each, an untimed one after
            # the switch back to eager: the search ends at step 6
            json.dump({"compile": {"strategies": ["inductor"], "measure_rounds": 1, "warmup_steps": 0,
                                   "cache": False, "verbose": False}}, f)
        stock = _load(run_ranks(_optimizer_train, 2, 1, False, 6, rank_env=env, timeout=600))
        ours = _load(run_ranks(_optimizer_train, 2, 1, False, 6, flags, rank_env=env, timeout=600))
    chosen = {o["compile"]["chosen"] for o in ours}
    assert len(chosen) == 1 and chosen <= {"eager", "inductor"}, [o["compile"] for o in ours]
    for s, o in zip(stock, ours):
        report = o["compile"]
        assert report["fallback"] is None and report["decided_at_step"] == 6, report
        inductor = next(c for c in report["candidates"] if c["name"] == "inductor")
        assert inductor["status"] in ("measured", "chosen") and inductor["graphs"] >= 1, report
        torch.testing.assert_close(o["losses"], s["losses"], rtol=1e-4, atol=0)
        torch.testing.assert_close(o["params"], s["params"], rtol=0, atol=1e-4)
        assert o["losses"][-1] < o["losses"][0]


def _cpu_workarounds():
    """megatron-core 0.16 on CPU, in the ranks only: what the bench does and prints."""
    from slipstream.bench.workers.megatron import cpu_workarounds

    cpu_workarounds()


def _gpt(tp: int, spec):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=128, tensor_model_parallel_size=tp, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
                            add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu)
    torch.manual_seed(0)
    return GPTModel(cfg, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=64,
                    position_embedding_type="rope")


def _gpt_batch():
    lengths = torch.tensor([32, 9, 25, 3, 17])
    g = torch.Generator().manual_seed(1)
    tokens, labels = (torch.randint(0, 128, (5, 32), generator=g) for _ in range(2))
    mask = (torch.arange(32)[None] < lengths[:, None]).long()  # right padding
    return tokens, labels, mask


def _loss_and_grads(model, **kwargs):
    model.zero_grad()
    loss_mask = kwargs.pop("loss_mask")
    loss = (model(**kwargs) * loss_mask).sum()  # megatron returns the per-token loss
    loss.backward()
    return loss.detach(), torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _packed_gpt(rank, world, tp):
    """A small GPTModel (rope, GQA, SwiGLU) at TP=``tp``: the padded batch, the same batch packed
    (THD) through slipstream's attention, and the packed row without sequence boundaries."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from slipstream import megatron
    from slipstream.core_comm import counters

    _cpu_workarounds()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tokens, labels, mask = _gpt_batch()
    b, s = tokens.shape
    counters.reset()
    model = _gpt(tp, megatron.local_spec())
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]  # True: masked
    out = {"padded": _loss_and_grads(model, input_ids=tokens, position_ids=torch.arange(s).expand(b, s),
                                     attention_mask=causal, labels=labels, loss_mask=mask)}
    packed = megatron.pack_batch(tokens, labels, mask)
    out["packed"] = _loss_and_grads(model, **packed, attention_mask=None)
    t = packed["input_ids"].shape[1]
    out["naive"] = _loss_and_grads(model, input_ids=packed["input_ids"], position_ids=torch.arange(t)[None],
                                   attention_mask=torch.triu(torch.ones(t, t, dtype=torch.bool), 1)[None, None],
                                   labels=packed["labels"], loss_mask=packed["loss_mask"])
    out["counts"] = counters.snapshot()
    # the stock class, patched (what --slipstream-varlen does), then restored
    stock = _gpt(tp, get_gpt_layer_local_spec())
    megatron.enable_packed_attention()
    megatron.enable_packed_attention()  # idempotent
    try:
        out["patched"] = _loss_and_grads(stock, **packed, attention_mask=None)
    finally:
        megatron.disable_packed_attention()
    try:
        _loss_and_grads(stock, **packed, attention_mask=None)
        out["restored"] = "accepted packed sequences"
    except AssertionError as e:
        out["restored"] = str(e)
    parallel_state.destroy_model_parallel()
    return _bytes(out)


def test_packed_sequences_through_the_local_attention_equal_the_padded_gpt_at_tp2_on_slipstream_and_gloo():
    env = [{"SLIPSTREAM_NODE": "0"}] * 2
    stock = _load(run_ranks(_packed_gpt, 2, 2, rank_env=env, timeout=300))
    ours = _load(run_ranks(_packed_gpt, 2, 2, rank_env=env, backend="slipstream", timeout=300))
    for s, o in zip(stock, ours):
        for case in ("padded", "packed"):  # TP sums of two partials: bit-equal across backends
            assert torch.equal(o[case][0], s[case][0]) and torch.equal(o[case][1], s[case][1]), case
        assert set(o["counts"]["all_reduce"]) & {"shm", "cma"}, o["counts"]
        (padded, g_padded), (packed, g_packed), (naive, _) = o["padded"], o["packed"], o["naive"]
        # per-sequence attention against the batched masked one: fp32 rounding of the same sums
        torch.testing.assert_close(packed, padded, rtol=1e-5, atol=0)
        torch.testing.assert_close(g_packed, g_padded, rtol=1e-4, atol=1e-6)
        # without the boundaries the loss is off by far more than that tolerance: the test can fail
        assert abs(naive - padded) > 10 * 1e-5 * abs(padded), (naive, padded, packed)
        assert torch.equal(o["patched"][0], packed) and torch.equal(o["patched"][1], g_packed)
        assert "Packed sequence is not supported" in o["restored"], o["restored"]


def _refusals(rank, world):
    from dataclasses import replace

    from megatron.core import parallel_state

    from slipstream import megatron

    _cpu_workarounds()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model = _gpt(1, megatron.local_spec())
    tokens, labels, mask = _gpt_batch()
    packed = megatron.pack_batch(tokens, labels, mask)
    good = packed["packed_seq_params"]
    cu = good.cu_seqlens_q
    bad = {"sbhd": replace(good, qkv_format="sbhd"), "cross": replace(good, cu_seqlens_kv=cu[[0, -1]]),
           "padded": replace(good, cu_seqlens_q_padded=cu * 2)}
    errors = {}
    attention = model.decoder.layers[0].self_attention.core_attention
    q, kv = torch.randn(cu[-1].item(), 4, 16), torch.randn(cu[-1].item(), 2, 16)  # 4 heads, 2 groups
    bad["short"] = replace(good, cu_seqlens_q=cu[:-1], cu_seqlens_kv=cu[:-1])  # offsets short of the tokens
    for name, params in bad.items():
        try:
            megatron.packed_attention(attention, q, kv, kv, None, None, params)
            errors[name] = None
        except (NotImplementedError, ValueError) as e:
            errors[name] = str(e)
    assert megatron.packed_attention(attention, q, kv, kv, None, None, good).shape == (q.shape[0], 64)
    try:
        megatron.pack_batch(tokens, labels[:, :-1], mask)
    except ValueError as e:
        errors["shapes"] = str(e)
    parallel_state.destroy_model_parallel()
    return errors


def test_packed_attention_refuses_what_it_does_not_compute_by_name():
    (errors,) = run_ranks(_refusals, 1, timeout=120)
    assert "qkv_format 'sbhd'" in errors["sbhd"]
    assert "cross attention" in errors["cross"]
    assert "cu_seqlens_q_padded differs" in errors["padded"]
    assert "covers" in errors["short"] and "tokens" in errors["short"]
    assert "pack_batch takes (batch, seq) tensors of one shape" in errors["shapes"]


@pytest.mark.slow
def test_bench_megatron_runs_gloo_and_slipstream_padded_and_packed_with_equal_losses(tmp_path):
    """``slipstream bench megatron`` end to end on one node: a GPT at TP=2 trained with
    Megatron's DDP across the two TP pairs (TP=2 x DP=2 on one node), three jobs, with
    Megatron's ``overlap_grad_reduce`` (small buckets, all-reduced during backward)."""
    from slipstream.cli import main

    figures = tmp_path / "records.json"
    assert main(["bench", "megatron", "--layout", "1x4", "--tp", "2", "--samples", "64", "--max-length", "256",
                 "--batch", "4", "--steps", "2", "--warmup", "1", "--hidden", "64", "--layers", "2", "--heads", "4",
                 "--overlap", "--bucket", "20000", "--json", str(figures)]) == 0
    (record,) = json.loads(figures.read_text())
    stock, padded, packed = record["jobs"]
    assert (stock["backend"], padded["backend"], packed["backend"]) == ("gloo", "slipstream", "slipstream")
    assert not stock["packed"] and not padded["packed"] and packed["packed"]
    assert stock["comm_paths"] == {} and "cpu:slipstream" in padded["world_backend"]
    assert set(padded["comm_paths"]["all_reduce"]) & {"shm", "cma"}, padded["comm_paths"]  # the TP all-reduces
    # Megatron DDP's bucket all-reduce across the TP pairs, issued in torch's coalescing manager
    assert set(padded["comm_paths"]["all_reduce_coalesced"]) & {"shm", "cma"}, padded["comm_paths"]
    # same data, same seed: the packed model computes the padded one's losses
    assert padded["max_rel_loss_diff"] <= 1e-6 and packed["max_rel_loss_diff"] <= 1e-5, record
    assert packed["padding_removed"] > 0.1
    # where the step's time goes: slipstream's collectives on the core's timeline, none for gloo
    assert len(padded["comm_s"]) == 2 and min(padded["comm_s"]) > 0 and max(stock["comm_s"]) == 0
    assert all(0 <= e <= c + 1e-3 for e, c in zip(padded["exposed_s"], padded["comm_s"]))
    assert all(0 <= least <= c for least, c in zip(padded["comm_least_s"], padded["comm_s"]))  # the least, the most
    # overlap_grad_reduce: a bucket's all-reduce in flight on the core's thread while backward went on
    assert padded["overlap"] and max(padded["hidden_s"]) > 0, padded


def _reversed_sums(rank, world):
    """Megatron DDP's bucket all-reduce under ``--reversed-sums`` against gloo's, and against
    the sum in reversed rank order taken here."""
    from megatron.core.distributed import param_and_grad_buffer

    from slipstream.bench.workers.megatron import _sum_in_reversed_rank_order

    values = [torch.randn(5000, generator=torch.Generator().manual_seed(r)) * 10 ** r for r in range(world)]
    stock = values[rank].clone()
    dist.all_reduce(stock)
    reference = values[-1].clone()
    for v in reversed(values[:-1]):
        reference += v
    _sum_in_reversed_rank_order()
    ours = values[rank].clone()
    with param_and_grad_buffer._coalescing_manager(dist.group.WORLD, async_ops=False):
        dist.all_reduce(ours, op=dist.ReduceOp.SUM)
    top = values[rank].clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)  # not a sum: the stock call's
    try:
        dist.all_reduce(ours.clone(), async_op=True)
    except ValueError as e:
        refused = str(e)
    return {"equal_reference": torch.equal(ours, reference),
            "close_stock": torch.allclose(ours, stock, rtol=1e-6, atol=1e-3),
            "differs_from_stock": not torch.equal(ours, stock), "refused": refused,
            "max": torch.equal(top, torch.stack(values).max(0).values)}


def test_reversed_sums_take_every_data_parallel_sum_in_another_order_than_gloo():
    """``bench megatron --rounding``'s reference job: the same sums as gloo's all-reduce, each
    taken in reversed rank order (exactly), so its losses differ from stock's by rounding alone."""
    results = run_ranks(_reversed_sums, 4, timeout=120)
    assert all(r["equal_reference"] and r["close_stock"] for r in results), results
    assert any(r["differs_from_stock"] for r in results)  # another order: some element rounds otherwise
    assert all(r["max"] and "synchronous all-reduces only" in r["refused"] for r in results)


def test_bench_megatron_refuses_rounding_without_the_packed_job():
    from slipstream.cli import main

    with pytest.raises(SystemExit, match="--rounding"):
        main(["bench", "megatron", "--rounding", "--no-varlen"])


def test_bench_megatron_refuses_a_tp_that_crosses_nodes():
    from slipstream.cli import main

    with pytest.raises(SystemExit, match="--tp 4: must divide the ranks per node"):
        main(["bench", "megatron", "--layout", "2x2@1gbit", "--tp", "4"])


def _auto_overlap(rank, world):
    """Megatron's DDP built as a job builds it (``overlap_grad_reduce`` off, buckets of one
    layer), under slipstream's default ``"overlap": "auto"``: on a slow link (each all-reduce as
    long as a layer's backward) and on a fast one (no delay, layers of longer backward); and
    with ``"overlap": false``, Megatron's own blocking path. Per run: what the trial chose, the
    losses and weights, whether the trial was still running after each step, the job's own
    config afterwards, and each step's all-reduces issued while backward went on."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from _overlap_trial import LAYER, Layers, batch, slow_link
    from slipstream.core_comm import CommConfig
    from slipstream.core_comm.tuner import overlap as ot
    from slipstream.plugins.megatron import uninstall

    _cpu_workarounds()

    def train(overlap, delay_s, compute_s, steps):
        slipstream.enable(CommConfig(timeout_s=60, overlap=overlap))
        parallel_state.initialize_model_parallel()
        torch.manual_seed(0)
        model = Layers(compute_s)
        own = DistributedDataParallelConfig(grad_reduce_in_fp32=True, bucket_size=LAYER)
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
        losses, in_trial, during, calls = [], [], [], []
        with slow_link(delay_s, "all_reduce") as sizes:  # the link named before the trial keys its choice
            ddp = DistributedDataParallel(config, own, model)
            first = ddp.ddp_config.overlap_grad_reduce  # the mode the first step runs in
            for step in range(steps):
                sizes.clear()
                ddp.zero_grad_buffer()
                x, y = batch(rank, step)
                loss = (ddp(x) - y).pow(2).mean()
                loss.backward()
                # an overlapped step has issued its buckets' all-reduces before backward ended
                during.append(any(g.grad_reduce_handle is not None for g in ddp.bucket_groups))
                ddp.finish_grad_sync()
                calls.append([n for n in sizes if n >= LAYER])  # the trial's agreement of 2 numbers aside
                with torch.no_grad():
                    for p in ddp.parameters():
                        p -= 0.01 * p.main_grad
                losses.append(loss.item())
                facts = slipstream.status()["stacks"]["megatron"]
                in_trial.append(facts.get("buckets_during_backward") == "auto (in trial)")
        weights = [p.detach().clone() for p in ddp.parameters()]
        parallel_state.destroy_model_parallel()
        uninstall()
        return {"losses": losses, "weights": weights, "overlap": facts.get("overlap"), "in_trial": in_trial,
                "during_backward": facts.get("buckets_during_backward"), "issued_during": during,
                "calls": calls, "own_flag": own.overlap_grad_reduce, "buckets": len(ddp.bucket_groups),
                "first": first}

    steps = ot.WARMUP + 2 * ot.ROUNDS + 1
    runs = {"slow link": train("auto", 0.08, 0.08, steps), "fast link": train("auto", 0.0, 0.25, steps),
            "blocking": train(False, 0.0, 0.0, steps)}
    runs["cached"] = train("auto", 0.08, 0.08, 2)  # the slow link's choice, kept by its trial
    reference = runs["blocking"]["losses"], runs["blocking"]["weights"]
    for run in runs.values():  # either mode reduces the same buckets with the same values
        weights, n = run.pop("weights"), len(run["losses"])
        run["bit_equal"] = run["losses"] == reference[0][:n] and (
            n < steps or all(torch.equal(a, b) for a, b in zip(weights, reference[1])))
    return runs


@pytest.mark.slow
def test_megatron_ddp_overlap_auto_chooses_by_measurement_bit_equal_to_megatrons_blocking_path(tmp_path):
    from _overlap_trial import LAYER
    from slipstream.core_comm.tuner import overlap as ot

    env = {"SLIPSTREAM_OVERLAP_DIR": str(tmp_path), "SLIPSTREAM_NODE": "0"}
    for runs in run_ranks(_auto_overlap, 2, env=env, backend="slipstream", timeout=300):
        slow, fast, blocking = runs["slow link"], runs["fast link"], runs["blocking"]
        assert slow["during_backward"] is True and "buckets overlapped (measured" in slow["overlap"], slow
        assert fast["during_backward"] is False and "buckets blocking (measured" in fast["overlap"], fast
        decided = ot.WARMUP + 2 * ot.ROUNDS  # the trial's last step
        assert slow["in_trial"] == [True] * (decided - 1) + [False] * (len(slow["in_trial"]) + 1 - decided), slow
        # blocking first, then overlapped and blocking in turns (the first overlapped step issues
        # at the end, as Megatron's does), the choice after the trial
        assert slow["issued_during"] == [False, False, False, True, False, True, False, True, True], slow
        assert not any(fast["issued_during"][decided:]) and not any(blocking["issued_during"]), (fast, blocking)
        # a blocking step all-reduces the whole gradient in one call, as Megatron's own blocking
        # DDP does; an overlapped one a call a bucket (the first, step 1, at the end of backward)
        whole, buckets = [4 * LAYER], [LAYER] * 4
        after = len(fast["calls"]) - decided
        assert blocking["calls"] == [whole] * len(blocking["calls"]) and fast["calls"][decided:] == [whole] * after, fast
        assert slow["calls"] == [buckets if during or step == 1 else whole
                                 for step, during in enumerate(slow["issued_during"])], slow["calls"]
        assert blocking["overlap"] == "forced off" and blocking["buckets"] == 1  # Megatron's own: one bucket
        assert slow["buckets"] == fast["buckets"] == 4  # one a layer, as the job's config asked
        assert not any(run["own_flag"] for run in runs.values())  # the job's config object is untouched
        # a cached choice holds from the first step (its buckets a call each), every rank agreeing
        # when the DDP was built: no blocking step at the whole gradient first
        cached = runs["cached"]
        assert cached["first"] is True and slow["first"] is False, (cached, slow)
        assert cached["during_backward"] is True and "cached from an earlier run" in cached["overlap"], cached
        assert cached["calls"][0] == buckets and not any(cached["in_trial"]), cached
        assert all(run["bit_equal"] for run in runs.values()), runs
    assert len(list(tmp_path.iterdir())) == 2  # one choice for the model and layout on each link
