"""One rank of ``slipstream finetune``: DeepSpeed ZeRO training of a causal LM on alpaca data.

Started by ``slipstream.recipes.finetune`` through torch's launcher. Stock and slipstream runs
share everything but the ``"slipstream"`` config section: the same samples in the same
micro-batches (split across ranks by tokens), the same seed, and the same loss, the step's
summed cross-entropy over its global count of target tokens (exact under accumulation).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch
import torch.distributed as dist

from ..cluster.worker import cores_per_rank, run_worker
from ..core_compile import step_loss
from ..plugins.deepspeed.translate import grad_reduction
from .comm_timer import CommTimer, Timed
from .training import add_options, prepare, summary, train_steps

CONFIGS = resources.files("slipstream") / "configs"  # zero<N>.json, shipped as package data
# DeepSpeed's collectives (its communication backend's methods) that are timed
COMM_OPS = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast", "reduce",
            "all_gather", "barrier", "all_reduce_coalesced")


def ds_config(args) -> dict:
    path = Path(args.config) if args.config else CONFIGS / f"zero{args.zero}.json"
    cfg = json.loads(path.read_text())
    cfg["train_micro_batch_size_per_gpu"] = args.batch_size
    cfg["gradient_accumulation_steps"] = args.grad_accum
    cfg.setdefault("zero_optimization", {})["stage"] = args.zero
    cfg.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
    if args.impl == "stock":  # stock even where slipstream is on (SLIPSTREAM=1 engages a config without a section)
        cfg["slipstream"] = {"enabled": False}
        return cfg
    section = cfg.setdefault("slipstream", {"enabled": True})
    if args.compile:
        section["compile"] = {"enabled": True, "expected_steps": args.steps * args.grad_accum}  # forward calls
    if args.no_varlen:  # the collectives alone
        section["varlen"] = {"enabled": False}
    return cfg


def init_distributed(args) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")


def train(args) -> dict:
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    import slipstream.deepspeed as sds

    world = dist.get_world_size()
    tokenizer, samples, model = prepare(args)
    init = deepspeed.initialize if args.impl == "stock" else sds.initialize
    config = ds_config(args)
    varlen = args.impl != "stock" and config.get("slipstream", {}).get("varlen", {}).get("enabled", False)
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=config)
    timer, backend = CommTimer(), ds_comm.cdb
    ds_comm.cdb = Timed(backend, timer, ops=COMM_OPS, wait_suffix=".wait")
    reduction = grad_reduction()

    def step(micro, tokens):
        loss_sum = torch.zeros(())
        for m in micro:
            out = engine(**m, num_items_in_batch=1)  # the summed loss of the micro-batch
            engine.backward(step_loss(out.loss, tokens, dp_world_size=world, grad_accum_steps=args.grad_accum,
                                      reduction=reduction))
            engine.step()
            loss_sum += out.loss.detach()
        return loss_sum

    try:
        records = train_steps(args, samples, tokenizer.pad_token_id, timer, step)
    finally:
        ds_comm.cdb = backend
    ckpt = Path(args.output_dir) / f"checkpoint-{args.impl}"
    engine.save_checkpoint(str(ckpt), tag=f"step{args.steps}")
    return summary(args, records, timer, engine.module, varlen=varlen, checkpoint=str(ckpt))


if __name__ == "__main__":
    # DeepSpeed joins the group; the ranks leave with its groups standing, as they always have
    run_worker(train, options=add_options, group=init_distributed, threads=cores_per_rank, destroy_group=False)
