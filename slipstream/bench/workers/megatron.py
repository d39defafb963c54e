"""One rank of ``slipstream bench megatron``: a megatron-core ``GPTModel`` (local spec, rope)
trained with tensor parallelism inside a node and Megatron's DDP across the data-parallel
group, on alpaca data, on ``--backend`` gloo or slipstream, with padded or packed (THD) batches.

Padded batches use a causal mask; packed ones are one row of the real tokens with
``PackedSeqParams`` through slipstream's packed attention. The loss is the sum of the
per-token losses over the step's real target tokens of every data-parallel rank, so padded and
packed runs train the same numbers. The result: the step times (the slowest rank's), the
losses, the time slipstream's collectives were in flight and the part a caller waited on
(``comm_s``, ``exposed_s``, and ``hidden_s`` in flight while no caller waited: the core's
timeline, empty on gloo), the bytes all ranks sent across the node links per step, and the
per-collective paths.

megatron-core 0.16 asks CUDA for things a CPU run does not need; this worker (and the tests)
work around them, and only here: see ``CPU_WORKAROUNDS``, printed in the bench's report.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time

import torch
import torch.distributed as dist

import slipstream
from slipstream.cluster.worker import add_flags, cores_per_rank, least, run_worker, slowest

CPU_WORKAROUNDS = (
    "torch.cuda.current_device() answers 'cpu' (megatron-core puts the rotary frequencies and "
    "Megatron DDP's gradient buffers there)",
    "the model-parallel RNG fork around dropout is a no-op (dropout is 0: no random number is drawn)",
)


def cpu_workarounds() -> None:
    """What ``CPU_WORKAROUNDS`` says, in this process only (a bench or test rank)."""
    from megatron.core import tensor_parallel

    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def gpt(hidden: int, layers: int, heads: int, vocab: int, max_length: int, tp: int):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from slipstream.megatron import local_spec

    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                               num_query_groups=max(1, heads // 2), ffn_hidden_size=4 * hidden,
                               tensor_model_parallel_size=tp, use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0, normalization="RMSNorm", add_bias_linear=False,
                               gated_linear_unit=True, activation_func=F.silu)
    torch.manual_seed(0)
    return GPTModel(config, transformer_layer_spec=local_spec(), vocab_size=vocab, max_sequence_length=max_length,
                    position_embedding_type="rope"), config


def next_token_batch(samples: list[dict], pad_id: int) -> dict:
    """Padded ``tokens`` and Megatron's labels (the next token at each position), with the loss
    mask of the positions that have a target."""
    from slipstream.recipes.alpaca import pad_batch

    b = pad_batch(samples, pad_id)
    target = torch.full_like(b["labels"], -100)
    target[:, :-1] = b["labels"][:, 1:]
    return {"tokens": b["input_ids"], "labels": target.clamp(min=0), "loss_mask": (target != -100).float(),
            "attention_mask": b["attention_mask"]}


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("gloo", "slipstream"), required=True)
    # --reversed-sums: the stock job once more, each sum of the data-parallel ranks taken in
    # reversed rank order (an all-gather, then the sum): another stock order of the same sums,
    # which shows how far float32 rounding alone moves the losses (``bench megatron --rounding``)
    add_flags(p, {"--tp": int, "--packed": False, "--overlap": False, "--reversed-sums": False, "--bucket": 1_000_000,
                  "--data": None, "--samples": 400, "--max-length": 512, "--batch": 8, "--steps": 10, "--warmup": 2,
                  "--hidden": 256, "--layers": 4, "--heads": 8, "--lr": 1e-3, "--seed": 0})


def train(args: argparse.Namespace) -> dict:
    cpu_workarounds()

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from slipstream.core_comm import counters
    from slipstream.recipes.tokenizer import load_tokenizer
    from slipstream.recipes.training import micro_batches, training_samples

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    if args.reversed_sums:
        _sum_in_reversed_rank_order()
    dp_group = parallel_state.get_data_parallel_group()
    dp_rank, dp_world = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    tokenizer = load_tokenizer(None)
    samples = training_samples(args, tokenizer)
    vocab = math.ceil(len(tokenizer) / (128 * args.tp)) * 128 * args.tp  # Megatron pads the vocabulary so
    model, config = gpt(args.hidden, args.layers, args.heads, vocab, args.max_length, args.tp)
    params = sum(q.numel() for q in model.parameters())
    # --overlap: each bucket's all-reduce issued asynchronously as backward fills it, waited in
    # finish_grad_sync (Megatron's own overlap_grad_reduce, on either backend)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=args.overlap,
                                        bucket_size=args.bucket if args.overlap else None)
    model = DistributedDataParallel(config, ddp, model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    times, losses, comm, exposed, hidden, real, padded = [], [], [], [], [], 0, 0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            counters.reset()
        (micro,) = micro_batches(samples, step, dp_rank, dp_world, batch_size=args.batch, seed=args.seed)
        b = next_token_batch(micro, tokenizer.pad_token_id)
        seconds, loss = _step(model, opt, b, args.packed, dp_group)
        times.append(seconds)
        losses.append(loss)
        spent = counters.timeline.take()  # slipstream's collectives only: gloo's are out of sight
        comm.append(spent["comm_s"])
        exposed.append(spent["exposed_s"])
        hidden.append(spent["hidden_s"])
        if step >= args.warmup:
            real += int(b["attention_mask"].sum())
            padded += b["attention_mask"].numel()
    tokens = torch.tensor([real, padded, counters.link_bytes() / args.steps], dtype=torch.float64)
    dist.all_reduce(tokens)
    result = dict(backend=args.backend, tp=args.tp, dp=dp_world, packed=args.packed, overlap=args.overlap,
                  reversed_sums=args.reversed_sums,
                  params=params,
                  times_s=slowest({"step": times[args.warmup:]})["step"], losses=losses,
                  **slowest({"comm_s": comm[args.warmup:], "exposed_s": exposed[args.warmup:],
                             "hidden_s": hidden[args.warmup:]}),
                  comm_least_s=least({"comm": comm[args.warmup:]})["comm"],
                  real_tokens=tokens[0].item() / args.tp, padded_tokens=tokens[1].item() / args.tp,
                  link_bytes=tokens[2].item(), comm_paths=counters.snapshot(),
                  overlap_choice=slipstream.status()["stacks"].get("megatron", {}).get("overlap"),
                  world_backend=dist.get_backend_config())
    parallel_state.destroy_model_parallel()
    return result


def _sum_in_reversed_rank_order() -> None:
    """Every SUM all-reduce of this rank (Megatron DDP's gradients, the worker's loss) as an
    all-gather and a sum in reversed rank order, outside Megatron's coalescing manager; other
    ops as they were (this process only: a reference job's rank, on the stock backend)."""
    from megatron.core.distributed import param_and_grad_buffer

    stock = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op != dist.ReduceOp.SUM:  # the cross-entropy's MAX: no rounding to reorder
            return stock(tensor, op=op, group=group, async_op=async_op)
        if async_op:
            raise ValueError("--reversed-sums takes synchronous all-reduces only (no --overlap)")
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor, group=group)
        total = parts[-1].clone()
        for part in reversed(parts[:-1]):
            total += part
        tensor.copy_(total)

    @contextlib.contextmanager
    def uncoalesced(group=None, device=None, async_ops=False):
        yield None

    dist.all_reduce = all_reduce
    param_and_grad_buffer._coalescing_manager = uncoalesced


def _step(model, opt, b: dict, packed: bool, dp_group) -> tuple[float, float]:
    """Seconds of one training step on batch ``b`` (:func:`next_token_batch`) and its loss per
    target token over every data-parallel rank."""
    from slipstream.megatron import pack_batch

    t0 = time.perf_counter()
    if packed:
        p = pack_batch(b["tokens"], b["labels"], b["attention_mask"], b["loss_mask"])
        mask = p["loss_mask"]
        per_token = model(p["input_ids"], p["position_ids"], None, labels=p["labels"],
                          packed_seq_params=p["packed_seq_params"])
    else:
        s = b["tokens"].shape[1]
        mask = b["loss_mask"]
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]  # True: masked
        per_token = model(b["tokens"], torch.arange(s).expand_as(b["tokens"]), causal, labels=b["labels"])
    counts = torch.stack([mask.sum(), (per_token * mask).sum().detach()])
    dist.all_reduce(counts, group=dp_group)  # the step's target tokens and loss sum, every DP rank
    # Megatron's DDP divides each gradient by the DP size before summing: the loss over the
    # step's tokens, times that size, gives the gradient of the step's mean loss
    ((per_token * mask).sum() * (dist.get_world_size(dp_group) / counts[0])).backward()
    model.finish_grad_sync()
    for q in model.parameters():
        q.grad = q.main_grad
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.zero_grad_buffer()
    return time.perf_counter() - t0, (counts[1] / counts[0]).item()


def join(args: argparse.Namespace) -> None:
    """The default group on ``--backend``; slipstream's job turns slipstream on first, as a user
    does (``slipstream.enable()``: the Megatron adapter with its defaults, overlap auto among them)."""
    if args.backend == "slipstream":
        slipstream.enable()
    dist.init_process_group(args.backend)


if __name__ == "__main__":
    run_worker(train, options=options, group=join, threads=cores_per_rank)
