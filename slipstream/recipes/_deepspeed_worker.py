"""One rank of ``slipstream finetune``: DeepSpeed ZeRO training of a causal LM on alpaca data.

Started by ``slipstream.recipes.finetune`` through torch's launcher. Stock and slipstream runs
share everything but the ``"slipstream"`` config section: the same samples in the same
micro-batches (split across ranks by tokens), the same seed, and the same loss, the step's
summed cross-entropy over its global count of target tokens (exact under accumulation).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
from importlib import resources
from pathlib import Path

import torch
import torch.distributed as dist

from ..core_comm import counters
from ..core_compile import balance, global_token_count, step_loss
from ..plugins.deepspeed.translate import grad_reduction
from .alpaca import generate_alpaca, load_alpaca, pad_batch, tokenize_alpaca
from .model import build_model
from .tokenizer import load_tokenizer

CONFIGS = resources.files("slipstream") / "configs"  # zero<N>.json, shipped as package data
WARMUP_STEPS = 2  # excluded from the throughput medians: lazy set-up of comm and kernels


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for name, kind, default in [
        ("--impl", str, "slipstream"), ("--model", str, "llama-tiny"), ("--tokenizer", str, None),
        ("--data", str, None), ("--samples", int, 400), ("--max-length", int, 512),
        ("--steps", int, 20), ("--zero", int, 2), ("--batch-size", int, 8), ("--grad-accum", int, 1),
        ("--lr", float, 1e-3), ("--seed", int, 0), ("--config", str, None), ("--output-dir", str, "out"),
    ]:
        p.add_argument(name, type=kind, default=default)
    p.add_argument("--compile", action="store_true", help="slipstream runs: slipstream.compile")
    return p.parse_args(argv)


def ds_config(args) -> dict:
    path = Path(args.config) if args.config else CONFIGS / f"zero{args.zero}.json"
    cfg = json.loads(path.read_text())
    cfg["train_micro_batch_size_per_gpu"] = args.batch_size
    cfg["gradient_accumulation_steps"] = args.grad_accum
    cfg.setdefault("zero_optimization", {})["stage"] = args.zero
    cfg.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
    if args.impl == "stock":
        cfg.pop("slipstream", None)
    elif args.compile:
        cfg.setdefault("slipstream", {})["compile"] = {"enabled": True}
    return cfg


def load_samples(args, tokenizer) -> list[dict]:
    records = load_alpaca(args.data) if args.data else generate_alpaca(args.samples, seed=args.seed)
    samples = tokenize_alpaca(records, tokenizer)
    cut = sum(len(s["input_ids"]) > args.max_length for s in samples)
    if cut and dist.get_rank() == 0:
        print(f"finetune: {cut} of {len(samples)} samples truncated to --max-length {args.max_length} tokens",
              flush=True)
    samples = [{k: v[:args.max_length] for k, v in s.items()} for s in samples]
    return [s for s in samples if len(s["input_ids"]) > 1]


def step_micro_batches(samples, step, args, rank, world) -> list[list[dict]]:
    """This rank's micro-batches of ``step``: the step's samples split by tokens over every
    (rank, micro-step), the same split for stock and slipstream."""
    per_step = args.batch_size * world * args.grad_accum
    order = list(range(len(samples)))
    random.Random(args.seed + step // max(1, len(samples) // per_step)).shuffle(order)
    start = (step * per_step) % max(1, len(samples) - per_step + 1)
    chosen = order[start:start + per_step]
    lengths = [len(s["input_ids"]) for s in samples]
    groups = balance(lengths, chosen, world * args.grad_accum)
    mine = groups[rank * args.grad_accum:(rank + 1) * args.grad_accum]
    return [[samples[i] for i in g] for g in mine]


class CommTimer:
    """Wall time spent inside DeepSpeed's collectives (waits on async handles included)."""

    OPS = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast", "reduce",
           "all_gather", "barrier", "all_reduce_coalesced")

    def __init__(self, backend) -> None:
        self.backend = backend
        self.seconds = 0.0
        self.by_op: dict[str, list[float]] = {}  # op -> [calls, seconds], over the whole run

    def add(self, name: str, seconds: float) -> None:
        self.seconds += seconds
        entry = self.by_op.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    def __getattr__(self, name):
        attr = getattr(self.backend, name)
        if name not in self.OPS:
            return attr

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            handle = attr(*args, **kwargs)
            self.add(name, time.perf_counter() - t0)
            return _TimedHandle(handle, self, name) if handle is not None and hasattr(handle, "wait") else handle

        return timed


class _TimedHandle:
    def __init__(self, handle, timer, name) -> None:
        self._handle, self._timer, self._name = handle, timer, name

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self._handle.wait(*args, **kwargs)
        self._timer.add(self._name + ".wait", time.perf_counter() - t0)
        return out

    def __getattr__(self, name):
        return getattr(self._handle, name)


def train(args) -> dict:
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    import slipstream.deepspeed as sds

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = load_tokenizer(args.tokenizer or (args.model if os.path.isdir(args.model) else None))
    samples = load_samples(args, tokenizer)
    model = build_model(args.model, vocab_size=len(tokenizer), seed=args.seed, pad_token_id=tokenizer.pad_token_id)
    init = deepspeed.initialize if args.impl == "stock" else sds.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=ds_config(args))
    timer = ds_comm.cdb = CommTimer(ds_comm.cdb)
    reduction = grad_reduction()
    bar = _progress(args) if rank == 0 else None
    records = []
    counters.reset()  # the training steps' calls only
    try:
        for step in range(args.steps):
            records.append(_train_step(engine, samples, step, args, rank, world, reduction, timer, tokenizer))
            if bar is not None:
                r = records[-1]
                bar.set_postfix(loss=f"{r['loss']:.4f}", tok_s=f"{r['real_tokens'] / r['step_time_s']:.0f}", refresh=False)
                bar.update(1)
    finally:
        ds_comm.cdb = timer.backend
        if bar is not None:
            bar.close()
    ckpt = Path(args.output_dir) / f"checkpoint-{args.impl}"
    engine.save_checkpoint(str(ckpt), tag=f"step{args.steps}")
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {**_summary(args, records, float(peak), ckpt),
            "comm_by_op": {op: {"calls": n, "seconds": t} for op, (n, t) in sorted(timer.by_op.items())},
            "comm_paths": counters.snapshot(), "compile": compile_summary(engine.module)}


def compile_summary(model) -> dict | None:
    """What ``slipstream.compile`` measured and chose on this rank (None: not compiled)."""
    from ..core_compile import compile_report

    report = compile_report(model)
    return report.to_dict() if report is not None else None


def _train_step(engine, samples, step, args, rank, world, reduction, timer, tokenizer) -> dict:
    micro = [pad_batch(b, tokenizer.pad_token_id) for b in step_micro_batches(samples, step, args, rank, world)]
    timer.seconds = 0.0
    t0 = time.perf_counter()
    tokens = global_token_count([m["labels"] for m in micro], group=dist.group.WORLD)
    loss_sum = torch.zeros(())
    for m in micro:
        out = engine(**m, num_items_in_batch=1)  # the summed loss of the micro-batch
        loss = step_loss(out.loss, tokens, dp_world_size=world, grad_accum_steps=args.grad_accum,
                         reduction=reduction)
        engine.backward(loss)
        engine.step()
        loss_sum += out.loss.detach()
    return step_record(micro, loss_sum, tokens, time.perf_counter() - t0, timer.seconds)


def step_record(micro, loss_sum, tokens, elapsed: float, comm_seconds: float) -> dict:
    """A step's figures over every rank: loss per target token, real and padded tokens, times."""
    counts = torch.tensor([loss_sum.item(), sum(float(m["attention_mask"].sum()) for m in micro),
                           sum(float(m["attention_mask"].numel()) for m in micro)], dtype=torch.float64)
    dist.all_reduce(counts)
    return {"loss": counts[0].item() / max(1, int(tokens)), "real_tokens": counts[1].item(),
            "padded_tokens": counts[2].item(), "step_time_s": elapsed, "comm_time_s": comm_seconds}


def _progress(args):
    from tqdm import tqdm

    class _Lines:  # the launcher streams by line: one refreshed bar per line
        def write(self, s):
            sys.stdout.write(s.replace("\r", "\n") if s.strip() else "")

        def flush(self):
            sys.stdout.flush()

    return tqdm(total=args.steps, desc=f"finetune [{args.impl}]", file=_Lines(), mininterval=0, ascii=True,
                ncols=100)


def _summary(args, records, peak_mb, ckpt) -> dict:
    timed = records[WARMUP_STEPS:] or records
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    real = sum(r["real_tokens"] for r in timed)
    seconds = sum(r["step_time_s"] for r in timed)
    return {
        "impl": args.impl, "steps": args.steps, "zero": args.zero,
        "tokens_per_s": real / seconds, "step_time_s": median([r["step_time_s"] for r in timed]),
        "comm_time_s": median([r["comm_time_s"] for r in timed]), "peak_mem_mb": peak_mb,
        "padding_removed": _padding_removed(args, records),
        "losses": [r["loss"] for r in records], "final_loss": records[-1]["loss"], "checkpoint": str(ckpt),
    }


def _padding_removed(args, records) -> float:
    """Share of the padded batch's tokens the model did not compute (0 without the varlen pass)."""
    varlen = ds_config(args).get("slipstream", {}).get("varlen", {}).get("enabled", False)
    if args.impl == "stock" or not varlen:
        return 0.0
    return 1 - sum(r["real_tokens"] for r in records) / sum(r["padded_tokens"] for r in records)


def main(argv=None) -> None:
    args = parse(argv)
    summary = train(args)
    if dist.get_rank() == 0:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.impl}.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    from slipstream.cluster.worker import leave

    main()
    leave()
