"""One rank of ``slipstream finetune --stack fsdp``: PyTorch FSDP2 training of a causal LM on
alpaca data, the same samples, micro-batches, seed and loss as the DeepSpeed job.

Each decoder layer and the root are ``fully_shard``-ed (full sharding over the world, or with
``--hsdp`` a 2-D mesh: shard inside a node, replicate across nodes). Stock is plain FSDP2 on
gloo; slipstream applies the varlen pass to the model first (unless ``--no-varlen``) and routes
FSDP2's collectives through the core (``slipstream.fsdp.apply``). The optimizer is torch's AdamW.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..core_comm import counters
from ..core_compile import global_token_count, step_loss
from ..plugins.fsdp.translate import grad_reduction
from ._deepspeed_worker import (
    _progress,
    _summary,
    compile_summary,
    load_samples,
    parse,
    step_micro_batches,
    step_record,
)
from .alpaca import pad_batch
from .finetune import result_file
from .model import build_model
from .tokenizer import load_tokenizer


class _Timed:
    """Seconds spent in the collectives FSDP2 issues, per collective (the comm objects it calls)."""

    def __init__(self) -> None:
        self.by_op: dict[str, list] = {}
        self.seconds = 0.0

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self._add(name, time.perf_counter() - t0)
            return _TimedWork(out, self, name) if isinstance(out, dist.Work) else out

        return timed

    def _add(self, name, seconds):
        self.seconds += seconds
        entry = self.by_op.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds


class _TimedWork(dist.Work):
    """An async collective's handle whose ``wait`` is timed (FSDP waits on a ``dist.Work``)."""

    def __init__(self, work, timer: _Timed, name: str) -> None:
        super().__init__()
        self._work, self._timer, self._name = work, timer, name

    def wait(self, timeout=None) -> bool:
        t0 = time.perf_counter()
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._timer._add(self._name, time.perf_counter() - t0)
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self):
        return self._work.get_future()


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
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = load_tokenizer(args.tokenizer or (args.model if os.path.isdir(args.model) else None))
    samples = load_samples(args, tokenizer)
    model = build_model(args.model, vocab_size=len(tokenizer), seed=args.seed, pad_token_id=tokenizer.pad_token_id)
    ours = args.impl != "stock"
    if ours and not args.no_varlen:
        from ..core_compile import apply_varlen

        apply_varlen(model)
    _shard(model, args, world)
    timer = _Timed()
    if ours:
        from .. import fsdp

        fsdp.apply(model)
        if args.compile:
            from ..core_compile import compile as compile_

            compile_(model)  # after fully_shard: its hook-free regions
    _time_comms(model, timer)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    reduction = grad_reduction()
    bar = _progress(args) if rank == 0 else None
    records = []
    counters.reset()
    for step in range(args.steps):
        records.append(_train_step(model, opt, samples, step, args, rank, world, reduction, timer, tokenizer))
        if bar is not None:
            r = records[-1]
            bar.set_postfix(loss=f"{r['loss']:.4f}", tok_s=f"{r['real_tokens'] / r['step_time_s']:.0f}", refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    summary = _summary(args, records, float(peak), "")
    summary["compile"] = compile_summary(model)
    summary.update(stack="fsdp2" + ("-hsdp" if args.hsdp else ""), zero=None,
                   padding_removed=0.0 if not ours or args.no_varlen else
                   1 - sum(r["real_tokens"] for r in records) / sum(r["padded_tokens"] for r in records),
                   comm_by_op={op: {"calls": n, "seconds": t} for op, (n, t) in sorted(timer.by_op.items())},
                   comm_paths=counters.snapshot())
    dist.destroy_process_group()
    return summary


def _time_comms(model, timer: _Timed) -> None:
    """Time the all-gather / reduce-scatter objects of every FSDP param group, stock or ours,
    and HSDP's all-reduce across replicas (a plain ``dist.all_reduce`` in FSDP2's collectives
    module: whatever ``dist`` that module holds, torch's or slipstream's view, is timed)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    _fsdp_collectives.dist = _TimedComm(_fsdp_collectives.dist, timer.wrap("all_reduce",
                                                                             _fsdp_collectives.dist.all_reduce))

    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for attr, name in (("_all_gather_comm", "all_gather"), ("_reduce_scatter_comm", "reduce_scatter")):
                    comm = getattr(group, attr)
                    setattr(group, attr, _TimedComm(comm, timer.wrap(name, comm.__call__)))


class _TimedComm:
    """``comm`` with its call (a comm object) or its ``all_reduce`` (a module) timed."""

    def __init__(self, comm, call) -> None:
        self._comm, self._call = comm, call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def all_reduce(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._comm, name)


def _train_step(model, opt, samples, step, args, rank, world, reduction, timer, tokenizer) -> dict:
    micro = [pad_batch(b, tokenizer.pad_token_id) for b in step_micro_batches(samples, step, args, rank, world)]
    timer.seconds = 0.0
    t0 = time.perf_counter()
    tokens = global_token_count([m["labels"] for m in micro], group=dist.group.WORLD)
    loss_sum = torch.zeros(())
    for i, m in enumerate(micro):
        model.set_requires_gradient_sync(i == len(micro) - 1)
        out = model(**m, num_items_in_batch=1)  # the summed loss of the micro-batch
        step_loss(out.loss, tokens, dp_world_size=world, grad_accum_steps=args.grad_accum,
                  reduction=reduction).backward()
        loss_sum += out.loss.detach()
    opt.step()
    opt.zero_grad()
    return step_record(micro, loss_sum, tokens, time.perf_counter() - t0, timer.seconds)


def main(argv=None) -> None:
    import argparse

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--hsdp", action="store_true")
    extra.add_argument("--no-varlen", action="store_true")
    known, rest = extra.parse_known_args(argv)
    args = parse(rest)
    args.hsdp, args.no_varlen = known.hsdp, known.no_varlen
    summary = train(args)
    if int(os.environ.get("RANK", "0")) == 0:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        result_file(out, args.impl, args.hsdp).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    from slipstream.cluster.worker import leave

    main()
    leave()
