"""One rank of ``slipstream finetune --stack fsdp``: PyTorch FSDP2 training of a causal LM on
alpaca data, the same samples, micro-batches, seed and loss as the DeepSpeed job.

Each decoder layer and the root are ``fully_shard``-ed (full sharding over the world, or with
``--hsdp`` a 2-D mesh: shard inside a node, replicate across nodes). Stock is plain FSDP2 on
gloo; slipstream applies the varlen pass to the model first (unless ``--no-varlen``) and routes
FSDP2's collectives through the core (``slipstream.fsdp.apply``). The optimizer is torch's AdamW.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from ..cluster.worker import add_flags, cores_per_rank, run_worker
from ..core_compile import step_loss
from ..plugins.fsdp.overlap import param_groups
from ..plugins.fsdp.translate import grad_reduction
from .comm_timer import CommTimer, Timed
from .training import add_options, prepare, summary, train_steps


def _shard(model, args, world: int):
    from torch.distributed.fsdp import fully_shard

    mesh = None
    if args.hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        mesh = init_device_mesh("cpu", (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(args) -> dict:
    world = dist.get_world_size()
    tokenizer, samples, model = prepare(args)
    ours = args.impl != "stock"
    if ours and not args.no_varlen:
        from ..core_compile import apply_varlen

        apply_varlen(model)
    _shard(model, args, world)
    timer = CommTimer()
    if ours:
        from .. import fsdp

        fsdp.apply(model)
        if args.compile:
            from ..core_compile import CompileConfig, compile as compile_

            # after fully_shard: its hook-free regions; a forward call per micro-batch
            compile_(model, config=CompileConfig().with_run_length(args.steps, args.grad_accum))
    _time_comms(model, timer)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    reduction = grad_reduction()

    def step(micro, tokens):
        loss_sum = torch.zeros(())
        for i, m in enumerate(micro):
            model.set_requires_gradient_sync(i == len(micro) - 1)
            out = model(**m, num_items_in_batch=1)  # the summed loss of the micro-batch
            step_loss(out.loss, tokens, dp_world_size=world, grad_accum_steps=args.grad_accum,
                      reduction=reduction).backward()
            loss_sum += out.loss.detach()
        opt.step()
        opt.zero_grad()
        return loss_sum

    records = train_steps(args, samples, tokenizer.pad_token_id, timer, step)
    return summary(args, records, timer, model, varlen=ours and not args.no_varlen,
                   stack="fsdp2" + ("-hsdp" if args.hsdp else ""), zero=None)


def _time_comms(model, timer: CommTimer) -> None:
    """Time the all-gather / reduce-scatter objects of every FSDP param group, stock or ours,
    and HSDP's all-reduce across replicas (a plain ``dist.all_reduce`` in FSDP2's collectives
    module: whatever ``dist`` that module holds, torch's or slipstream's view, is timed)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    _fsdp_collectives.dist = Timed(_fsdp_collectives.dist, timer, ops=("all_reduce",))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in param_groups(module._get_fsdp_state()):
                for attr, name in (("_all_gather_comm", "all_gather"), ("_reduce_scatter_comm", "reduce_scatter")):
                    setattr(group, attr, Timed(getattr(group, attr), timer, call=name, wait_suffix=".wait"))


def options(p: argparse.ArgumentParser) -> None:
    add_options(p)
    add_flags(p, {"--hsdp": False})


if __name__ == "__main__":
    run_worker(train, options=options, threads=cores_per_rank)
