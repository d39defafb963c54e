"""One rank of a small GPT trained by megatron-core's own optimizer stack: Megatron's DDP and
``get_megatron_optimizer`` (Adam, fp32, gradient clipping), with or without the distributed
optimizer, which reduce-scatters the gradients and all-gathers the parameters over the
data-parallel group.

megatron-core 0.16's optimizers are written for CUDA; on a CPU test rank, and only there,
``CudaOnCpu`` stands in for it (its docstring says what it changes and why).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import slipstream  # noqa: F401 - registers the backend (the ranks import this module)
from _dist import to_bytes


class CudaOnCpu(TorchFunctionMode):
    """While active, in this process: a factory call asking for ``device='cuda'`` gets the CPU,
    and ``Tensor.type()`` names a CPU tensor by its CUDA type (``torch.cuda.FloatTensor``).

    megatron-core 0.16 allocates its optimizers' flags and norms with ``device='cuda'``
    (optimizer/optimizer.py:907 ``FP32Optimizer.__init__``, :481 and :485
    ``MixedPrecisionOptimizer.__init__``; optimizer/clip_grads.py:103) and sorts the
    parameters the distributed optimizer shards by ``param.type() == 'torch.cuda.FloatTensor'``
    (optimizer/distrib_optimizer.py:361, :420, :582), refusing a CPU one with a TypeError.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if args[0].is_cuda else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def train(rank: int, world: int, tp: int, distributed: bool, steps: int = 3, compile_flags: list | None = None) -> bytes:
    """``steps`` optimizer steps of a 2-layer GPT at TP=``tp`` (DP = world / tp), each DP rank on
    its own fixed (2, 16) batch. Returns (as bytes) ``losses: (steps,)``, each the mean over every
    DP rank's tokens before that step, the final ``params``, and this rank's path counts.
    ``compile_flags``: slipstream's Megatron-LM flags (``--slipstream-compile ...``), acted on
    before the model is wrapped; the compile report comes back as ``compile``."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from slipstream import megatron
    from slipstream.bench.workers.megatron import cpu_workarounds
    from slipstream.core_comm import counters
    from test_megatron import _gpt

    cpu_workarounds()
    if compile_flags is not None:
        import argparse

        megatron.initialize(megatron.add_arguments(argparse.ArgumentParser()).parse_args(compile_flags))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    dp = parallel_state.get_data_parallel_group()
    model = _gpt(tp, megatron.local_spec())
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed)
    model = DistributedDataParallel(model.config, ddp, model)
    with CudaOnCpu():
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0,
                                                     use_distributed_optimizer=distributed), [model])
    g = torch.Generator().manual_seed(1 + parallel_state.get_data_parallel_rank())
    tokens, labels = (torch.randint(0, 128, (2, 16), generator=g) for _ in range(2))
    s = tokens.shape[1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]  # True: masked
    losses = []
    counters.reset()
    for _ in range(steps):
        model.zero_grad_buffer()
        opt.zero_grad()
        # every DP rank has as many tokens: DDP's mean over DP of the ranks' means is the step's mean
        loss = model(tokens, torch.arange(s).expand_as(tokens), causal, labels=labels).mean()
        loss.backward()
        model.finish_grad_sync()  # distributed: reduce-scatter; otherwise all-reduce
        with CudaOnCpu():
            ok, _, _ = opt.step()  # distributed: the updated shards all-gathered
        assert ok, "megatron's optimizer skipped a step"
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp)
        losses.append(mean / dist.get_world_size(dp))
    out = {"losses": torch.stack(losses), "counts": counters.snapshot(),
           "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}
    if compile_flags is not None:
        report = slipstream.compile_report(model.module)
        out["compile"] = report.to_dict() if report is not None else None
        megatron.disable_compile()
    parallel_state.destroy_model_parallel()
    return to_bytes(out)
