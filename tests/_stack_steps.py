"""One training step of each stack on a tiny model, for the fault workers (``_fault_worker.py``,
``_netfault_worker.py``): ``make_step(stack)`` builds the model on the initialised default group
and returns ``step(i) -> loss``. Each step's batch depends only on the step and the rank, so
two runs of the same stack on the same layout compute the same losses, bit for bit, whatever
their links did.
"""

import torch
import torch.distributed as dist

STACKS = ("fsdp", "megatron", "deepspeed", "deepspeed3")
WIDTH = 512


def _batch(i: int, rows: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * i + dist.get_rank())
    return torch.randn(rows, WIDTH, generator=gen)


def make_step(stack: str):
    """``fsdp``: FSDP2 through ``slipstream.fsdp.apply``. ``megatron``: megatron-core TP=2 x DP
    layers (column- then row-parallel, 20 micro-batches a step, gradients averaged over the
    data-parallel group). ``deepspeed`` / ``deepspeed3``: ZeRO-2 / ZeRO-3 through the DeepSpeed
    adapter (with ``SLIPSTREAM_OVERLAP=1``, buckets of 256 Ki elements, reduced during
    backward)."""
    if stack == "fsdp":
        return _fsdp()
    if stack == "megatron":
        return _megatron()
    if stack in ("deepspeed", "deepspeed3"):
        return _deepspeed(3 if stack == "deepspeed3" else 2)
    raise ValueError(f"no stack {stack!r}: one of {STACKS}")


def _layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)])


def _fsdp():
    from torch.distributed.fsdp import fully_shard

    from slipstream import fsdp

    model = _layers()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    fsdp.apply(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(i: int) -> float:
        loss = model(_batch(i)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def _megatron():
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.model_parallel_config import ModelParallelConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True)
    torch.manual_seed(0)
    init = lambda w: torch.nn.init.normal_(w, std=0.02)  # noqa: E731
    col = tensor_parallel.ColumnParallelLinear(WIDTH, 2048, config=cfg, init_method=init, bias=True,
                                               gather_output=False)
    row = tensor_parallel.RowParallelLinear(2048, WIDTH, config=cfg, init_method=init, bias=True,
                                            input_is_parallel=True, skip_bias_add=False)
    params = [*col.parameters(), *row.parameters()]
    dp = parallel_state.get_data_parallel_group()

    def step(i: int) -> float:
        total = 0.0
        for micro in range(20):  # forward all-reduces of the row-parallel layer, then its backward's
            gen = torch.Generator().manual_seed(1000 * i + micro + 100 * dist.get_rank(dp))
            h, _ = col(torch.randn(64, 4, WIDTH, generator=gen))
            y, _ = row(torch.nn.functional.gelu(h))
            loss = y.pow(2).mean()
            loss.backward()
            total += loss.item()
        grads = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(grads, group=dp)
        with torch.no_grad():
            offset = 0
            for p in params:
                p -= 1e-3 * grads[offset:offset + p.numel()].view_as(p) / dp.size()
                offset += p.numel()
                p.grad = None
        return total

    return step


def _deepspeed(stage: int):
    """ZeRO-``stage`` on the default group (DeepSpeed adopts it), its collectives through the adapter."""
    import os

    import deepspeed

    model = _layers()
    config = {"train_micro_batch_size_per_gpu": 64, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_force_ds_cpu_optimizer": False, "slipstream": {"enabled": True}}
    if os.environ.get("SLIPSTREAM_OVERLAP") == "1":
        config["zero_optimization"]["reduce_bucket_size"] = 1 << 18
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(i: int) -> float:
        loss = engine(_batch(i)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step
