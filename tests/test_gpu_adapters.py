"""The adapters on NCCL groups (GPU machines only), each against the stock stack on the same
rank: DeepSpeed ZeRO-2 with a ``"slipstream"`` section against stock DeepSpeed's losses, FSDP2
after ``slipstream.fsdp.apply`` (which leaves FSDP2's own comms on NCCL) against stock FSDP2,
DDP with ``slipstream.ddp_hook`` against stock DDP. One rank on one GPU; with two GPUs or more, two ranks too (NCCL takes one GPU per
rank)."""

import pytest
import torch

from _dist import from_bytes, run_ranks, to_bytes

pytestmark = pytest.mark.gpu

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL takes one GPU per rank")


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))


def _batches(rank: int, steps: int, device):
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        yield torch.randn(8, 32, generator=g).to(device), torch.randn(8, 32, generator=g).to(device)


def _deepspeed_zero2(rank, world):
    import deepspeed

    import slipstream.deepspeed as sds
    from slipstream.plugins.deepspeed import installed_backend, uninstall

    torch.cuda.set_device(rank)
    runs = {}
    for name, init, section in (("stock", deepspeed.initialize, None),
                                ("ours", sds.initialize, {"enabled": True})):
        config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
                  "zero_optimization": {"stage": 2, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000},
                  "zero_force_ds_cpu_optimizer": False, "steps_per_print": 1000,
                  **({"slipstream": section} if section else {})}
        model = _mlp()
        engine, *_ = init(model=model, model_parameters=model.parameters(), config=config)
        losses = []
        for x, y in _batches(rank, 4, engine.device):
            loss = (engine(x) - y).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        runs[name] = (losses, [p.detach().float().cpu().clone() for p in engine.module.parameters()])
        if name == "ours":
            runs["installed"] = installed_backend() is not None
            uninstall()
    return to_bytes(runs)


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=two_gpus)])
def test_deepspeed_zero2_with_a_slipstream_section_matches_stock_deepspeed_on_nccl(world):
    pytest.importorskip("deepspeed")
    env = [{"LOCAL_RANK": str(r)} for r in range(world)]
    for runs in from_bytes(run_ranks(_deepspeed_zero2, world, backend="nccl", rank_env=env, timeout=300)):
        assert runs["installed"], "the slipstream section did not install the comm stand-in"
        torch.testing.assert_close(torch.tensor(runs["ours"][0]), torch.tensor(runs["stock"][0]), rtol=1e-5,
                                   atol=1e-6)
        for a, b in zip(runs["ours"][1], runs["stock"][1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32)
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.Linear(96, 63),
                                        torch.nn.GELU(), torch.nn.Linear(63, 32))
        self.head = torch.nn.Linear(32, 50, bias=False)

    def forward(self, ids):
        return self.head(self.body(self.emb(ids))).float()


def _fsdp2(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from slipstream import fsdp

    torch.cuda.set_device(rank)
    runs = {}
    for ours in (False, True):
        torch.manual_seed(0)
        model = _Tiny().cuda()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in (model.body[0], model.body[2], model.body[4]):  # 63: uneven shards
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        if ours:  # on NCCL every module keeps FSDP2's own comms (the routing decision)
            assert fsdp.apply(model) == [] and not fsdp.is_applied(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(3):
            ids = torch.randint(0, 50, (6, 5), generator=gen).cuda()
            loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(1, 1).flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        weights = [p.full_tensor().detach().float().cpu() for p in model.parameters()]
        runs["ours" if ours else "stock"] = (losses, weights)
        if ours:
            fsdp.remove(model)
    return to_bytes(runs)


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=two_gpus)])
def test_fsdp2_modules_on_nccl_are_left_to_fsdp2_and_match_stock(world):
    pytest.importorskip("torch.distributed.fsdp")
    for runs in from_bytes(run_ranks(_fsdp2, world, backend="nccl", timeout=240)):
        torch.testing.assert_close(torch.tensor(runs["ours"][0]), torch.tensor(runs["stock"][0]), rtol=1e-5, atol=1e-6)
        for a, b in zip(runs["ours"][1], runs["stock"][1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import slipstream

    torch.cuda.set_device(rank)
    runs = {}
    for name in ("stock", "ours"):
        model = DDP(_mlp().cuda(), device_ids=[rank], bucket_cap_mb=0.005)  # several buckets
        if name == "ours":
            model.register_comm_hook(None, slipstream.ddp_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for x, y in _batches(rank, 3, "cuda"):
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[name] = (losses, [p.detach().cpu().clone() for p in model.parameters()])
    return to_bytes(runs)


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=two_gpus)])
def test_ddp_hook_on_nccl_matches_stock_ddp(world):
    for runs in from_bytes(run_ranks(_ddp, world, backend="nccl", timeout=240)):
        torch.testing.assert_close(torch.tensor(runs["ours"][0]), torch.tensor(runs["stock"][0]), rtol=1e-5, atol=1e-6)
        for a, b in zip(runs["ours"][1], runs["stock"][1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
