"""What the fine-tune recipe's ranks share, DeepSpeed's (``_deepspeed_worker``) and FSDP2's
(``_fsdp_worker``): their options, the tokenizer, samples and model, each step's micro-batches
(the step's samples split by tokens, the same for stock and slipstream), the step loop with
each step's figures, and the run's summary. ``bench megatron``'s ranks train on the same
samples and micro-batches.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from .._common import record
from ..cluster.worker import add_flags, least, slowest
from ..core_comm import counters, pool
from ..core_compile import balance, global_token_count
from .alpaca import alpaca_samples, pad_batch
from .comm_timer import CommTimer
from .model import build_model
from .tokenizer import load_tokenizer, tokenizer_source

__all__ = ["WARMUP_STEPS", "add_options", "micro_batches", "prepare", "step_record", "summary", "train_steps",
           "training_samples"]

WARMUP_STEPS = 2  # excluded from the throughput medians: lazy set-up of comm and kernels


def add_options(p: argparse.ArgumentParser) -> None:
    """The options ``slipstream finetune`` hands every rank (``--compile``: slipstream runs compile)."""
    add_flags(p, {"--impl": "slipstream", "--model": "llama-tiny", "--tokenizer": None, "--data": None,
                  "--samples": 400, "--max-length": 512, "--steps": 20, "--zero": 2, "--batch-size": 8,
                  "--grad-accum": 1, "--lr": 1e-3, "--seed": 0, "--config": None, "--output-dir": "out",
                  "--compile": False, "--no-varlen": False})


def training_samples(args, tokenizer) -> list[dict]:
    """The tokenised samples of ``args.data`` (else ``args.samples`` generated from
    ``args.seed``), cut to ``args.max_length``; rank 0 says how many were cut."""
    samples, cut = alpaca_samples(tokenizer, data=args.data, samples=args.samples, seed=args.seed,
                                  max_length=args.max_length)
    if cut and dist.get_rank() == 0:
        print(f"finetune: {cut} of {len(samples)} samples truncated to --max-length {args.max_length} tokens",
              flush=True)
    return samples


def prepare(args) -> tuple:
    """``(tokenizer, samples, model)``: the model's tokenizer (or the one built locally), the
    samples, and the model with that vocabulary, seeded."""
    tokenizer = load_tokenizer(tokenizer_source(args.model, args.tokenizer))
    samples = training_samples(args, tokenizer)
    model = build_model(args.model, vocab_size=len(tokenizer), seed=args.seed, pad_token_id=tokenizer.pad_token_id)
    return tokenizer, samples, model


def micro_batches(samples, step: int, rank: int, world: int, *, batch_size: int, grad_accum: int = 1,
                  seed: int = 0) -> list[list[dict]]:
    """This rank's ``grad_accum`` micro-batches of ``step``: the step's ``batch_size x world x
    grad_accum`` samples split by tokens over every (rank, micro-step)."""
    per_step = batch_size * world * grad_accum
    order = list(range(len(samples)))
    random.Random(seed + step // max(1, len(samples) // per_step)).shuffle(order)
    start = (step * per_step) % max(1, len(samples) - per_step + 1)
    chosen = order[start:start + per_step]
    lengths = [len(s["input_ids"]) for s in samples]
    groups = balance(lengths, chosen, world * grad_accum)
    mine = groups[rank * grad_accum:(rank + 1) * grad_accum]
    return [[samples[i] for i in g] for g in mine]


def train_steps(args, samples, pad_id: int, timer: CommTimer,
                step: Callable[[list[dict], torch.Tensor], torch.Tensor]) -> list[dict]:
    """``args.steps`` steps, a progress bar on rank 0: each ``step(micro, tokens)`` on this
    rank's padded micro-batches and the step's global count of target tokens returns the summed
    loss of its micro-batches; its figures are :func:`step_record`'s."""
    rank, world = dist.get_rank(), dist.get_world_size()
    bar = _progress(args) if rank == 0 else None
    records = []
    counters.reset()  # the training steps' calls only
    try:
        for i in range(args.steps):
            micro = [pad_batch(b, pad_id) for b in micro_batches(samples, i, rank, world, batch_size=args.batch_size,
                                                                 grad_accum=args.grad_accum, seed=args.seed)]
            timer.seconds = 0.0
            counters.timeline.take()
            sent = counters.link_bytes()
            t0 = time.perf_counter()
            tokens = global_token_count([m["labels"] for m in micro], group=dist.group.WORLD)
            loss_sum = step(micro, tokens)
            elapsed, core = time.perf_counter() - t0, counters.timeline.take()
            # stock: every collective blocks the rank (the timer's waits included); ours: the core's timeline
            comm, exposed = (timer.seconds,) * 2 if args.impl == "stock" else (core["comm_s"], core["exposed_s"])
            records.append(step_record(micro, loss_sum, tokens, elapsed, comm, exposed, counters.link_bytes() - sent))
            if bar is not None:
                r = records[-1]
                bar.set_postfix(loss=f"{r['loss']:.4f}", tok_s=f"{r['real_tokens'] / r['step_time_s']:.0f}",
                                refresh=False)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return records


def step_record(micro, loss_sum, tokens, elapsed: float, comm_seconds: float, exposed_seconds: float | None = None,
                link_bytes: int = 0) -> dict:
    """A step's figures over every rank: loss per target token, real and padded tokens, times
    (this rank's): the step, with a collective in flight (``comm``), blocked on one
    (``exposed``), and the bytes each node sent across its link (over all its ranks)."""
    counts = torch.tensor([loss_sum.item(), sum(float(m["attention_mask"].sum()) for m in micro),
                           sum(float(m["attention_mask"].numel()) for m in micro), link_bytes], dtype=torch.float64)
    dist.all_reduce(counts)
    nodes = dist.get_world_size() // int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return {"loss": counts[0].item() / max(1, int(tokens)), "real_tokens": counts[1].item(),
            "padded_tokens": counts[2].item(), "step_time_s": elapsed, "comm_time_s": comm_seconds,
            "exposed_comm_s": comm_seconds if exposed_seconds is None else exposed_seconds,
            "link_bytes_per_node": counts[3].item() / max(1, nodes)}


def summary(args, records: list[dict], timer: CommTimer, model, *, varlen: bool, checkpoint: str = "",
            **fields) -> dict:
    """The run's figures (medians over the steps after :data:`WARMUP_STEPS`), the peak memory
    of the largest rank, the collectives' times and paths, what ``slipstream.compile`` measured
    and chose on this rank (None: not compiled), then ``fields``. ``varlen``: the model computes
    real tokens only (else no padding is removed)."""
    from ..core_compile import compile_report

    timed = records[WARMUP_STEPS:] or records
    real = sum(r["real_tokens"] for r in timed)
    seconds = sum(r["step_time_s"] for r in timed)
    # the most any rank held: its peak resident memory and the core's buffers within it
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, pool.held_bytes() / 2**20])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    compiled = compile_report(model)
    # a rank that computes longer makes the others wait in the step's first collective after it
    computes = [r["step_time_s"] - r["exposed_comm_s"] for r in timed]
    fewest = least({"comm": [r["comm_time_s"] for r in timed], "compute": computes})
    by_rank = torch.zeros(dist.get_world_size(), 2, dtype=torch.float64)  # each rank's medians: compute, exposed
    compute, exposed = (statistics.median_high(computes), statistics.median_high(r["exposed_comm_s"] for r in timed))
    by_rank[dist.get_rank()] = torch.tensor([compute, exposed], dtype=torch.float64)
    dist.all_reduce(by_rank)
    removed = 1 - sum(r["real_tokens"] for r in records) / sum(r["padded_tokens"] for r in records) if varlen else 0.0
    return {
        "impl": args.impl, "steps": args.steps, "zero": args.zero,
        "tokens_per_s": real / seconds, "step_time_s": statistics.median_high(r["step_time_s"] for r in timed),
        "comm_time_s": statistics.median_high(r["comm_time_s"] for r in timed), "peak_mem_mb": float(peak[0]),
        "core_buffers_mb": float(peak[1]) if args.impl != "stock" else None,
        "comm_least_s": statistics.median_high(fewest["comm"]),
        "exposed_comm_s": exposed, "compute_s": compute,
        "compute_slowest_s": statistics.median_high(slowest({"compute": computes})["compute"]),
        "compute_fastest_s": statistics.median_high(fewest["compute"]),
        "compute_exposed_by_rank_s": by_rank.tolist(),
        "link_bytes_per_node": statistics.median_high(r["link_bytes_per_node"] for r in timed),
        "padding_removed": removed,
        "losses": [r["loss"] for r in records], "final_loss": records[-1]["loss"], "checkpoint": checkpoint,
        "comm_by_op": timer.calls(), "comm_paths": counters.snapshot(),
        "compile": compiled.to_dict() if compiled is not None else None,
        "overlap": next((facts["overlap"] for facts in record.stacks().values() if facts.get("overlap")), None),
        **fields,
    }


def _progress(args):
    from tqdm import tqdm

    class _Lines:  # the launcher streams by line: one refreshed bar per line
        def write(self, s):
            sys.stdout.write(s.replace("\r", "\n") if s.strip() else "")

        def flush(self):
            sys.stdout.flush()

    return tqdm(total=args.steps, desc=f"finetune [{args.impl}]", file=_Lines(), mininterval=0, ascii=True,
                ncols=100)
