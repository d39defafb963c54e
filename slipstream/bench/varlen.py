"""``slipstream bench varlen``: one training step, padded vs varlen, side by side.

Both cases start from the same weights and see the same batches of alpaca-format data. A
step is forward + backward + AdamW step. The cases alternate (which one goes first flips
every step) so drift in a shared machine's load hits both; we report medians. Before timing,
one batch is run through both with identical weights to measure the loss and gradient
differences and the memory each needs.

Memory: on a GPU, the peak of ``torch.cuda.max_memory_allocated`` over one step; on a CPU,
where torch keeps no allocator statistics, the bytes of activations saved for backward
(distinct storages, parameters excluded), which is what padding inflates.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import random
import statistics
import sys
import time
from typing import Any

import torch

from slipstream.core_compile import FlattenCollator, VarlenConfig, apply_varlen
from slipstream.recipes.data import pad_batch

from ._output import cpu_model, emit

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", help="alpaca-format JSON (default: 1000 generated samples)")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per step (default 8)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case (default 10)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per case first (default 1)")
    parser.add_argument("--model", default="llama-20m", help="config name or local HF model directory")
    parser.add_argument("--tokenizer", help="local tokenizer path (default: a BPE built and cached locally)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="model vocabulary for config models")
    parser.add_argument("--max-length", type=int, default=2048, help="truncate samples to this many tokens")
    parser.add_argument("--backend", default="auto", help="varlen attention backend (default auto)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="auto: bf16 on GPU")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=1, help="time each step this often, keep the fastest")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--markdown", help="write the results table as markdown here")


def _data(args) -> tuple[list[dict], Any]:
    from slipstream.recipes import generate_alpaca, load_alpaca, load_tokenizer, tokenize_alpaca

    records = load_alpaca(args.data) if args.data else generate_alpaca(1000, seed=args.seed)
    tokenizer = load_tokenizer(args.tokenizer, vocab_size=args.vocab_size)
    samples = [s for s in tokenize_alpaca(records, tokenizer, max_length=args.max_length) if s["input_ids"]]
    random.Random(args.seed).shuffle(samples)
    return samples, tokenizer


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model, optimizer, batch, device, repeats: int) -> tuple[float, float]:
    """Wall and process-CPU seconds of one forward + backward + optimizer step: the fastest of
    ``repeats`` runs (contention from other processes only ever adds time)."""
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        _sync(device)
        start, cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        optimizer.step()
        _sync(device)
        best = min(best, (time.perf_counter() - start, time.process_time() - cpu))
    return best


def _saved_activation_bytes(model, batch) -> tuple[torch.Tensor, int]:
    """Loss of a forward and the bytes of distinct non-parameter storages saved for backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    return loss, sum(seen.values())


def _memory_and_loss(model, batch, device) -> tuple[torch.Tensor, int]:
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), torch.cuda.max_memory_allocated(device) - base
    loss, saved = _saved_activation_bytes(model, batch)
    loss.backward()
    return loss.detach(), saved


def _exactness(padded_model, varlen_model, padded, flat, device) -> dict[str, Any]:
    loss_p, mem_p = _memory_and_loss(padded_model, padded, device)
    loss_v, mem_v = _memory_and_loss(varlen_model, flat, device)
    grad_diff, grad_max, close = 0.0, 0.0, True
    for p, v in zip(padded_model.parameters(), varlen_model.parameters()):
        grad_diff = max(grad_diff, (p.grad.float() - v.grad.float()).abs().max().item())
        grad_max = max(grad_max, p.grad.float().abs().max().item())
        close = close and torch.allclose(v.grad.float(), p.grad.float(), rtol=1e-4, atol=1e-6)
    return {
        "loss_padded": loss_p.item(),
        "loss_varlen": loss_v.item(),
        "loss_abs_diff": abs(loss_p.item() - loss_v.item()),
        "loss_rel_diff": abs(loss_p.item() - loss_v.item()) / abs(loss_p.item()),
        "grad_max_abs_diff": grad_diff,
        "grad_max_abs": grad_max,
        "grads_allclose_rtol1e-4_atol1e-6": close,
        "memory_padded_bytes": mem_p,
        "memory_varlen_bytes": mem_v,
    }


def _environment(device: torch.device, dtype: torch.dtype, threads: int) -> dict[str, Any]:
    import transformers

    cpu = cpu_model()
    env = {
        "cpu": cpu,
        "cores": torch.multiprocessing.cpu_count(),
        "torch_threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "load_average_1min_at_end": os.getloadavg()[0],
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def run(args: argparse.Namespace) -> int:
    from slipstream.recipes import build_model, count_parameters

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    use_bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")
    dtype = torch.bfloat16 if use_bf16 else torch.float32
    samples, tokenizer = _data(args)
    n_batches = args.warmup + args.steps + 1
    if len(samples) < n_batches * args.batch_size:
        raise SystemExit(f"need {n_batches * args.batch_size} samples for {n_batches} batches, have {len(samples)}")
    batches = [samples[i * args.batch_size : (i + 1) * args.batch_size] for i in range(n_batches)]
    collate = FlattenCollator()
    padded = [_to(pad_batch(b, tokenizer.pad_token_id), device) for b in batches]
    flat = [_to(collate(b), device) for b in batches]

    vocab = max(args.vocab_size, len(tokenizer))
    padded_model = build_model(args.model, vocab_size=vocab, seed=args.seed, pad_token_id=tokenizer.pad_token_id)
    padded_model = padded_model.to(device=device, dtype=dtype).train()
    varlen_model = apply_varlen(copy.deepcopy(padded_model), VarlenConfig(backend=args.backend))
    exact = _exactness(padded_model, varlen_model, padded[0], flat[0], device)

    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in
            (("padded", padded_model), ("varlen", varlen_model))}  # fmt: skip
    models = {"padded": padded_model, "varlen": varlen_model}
    inputs = {"padded": padded, "varlen": flat}
    times: dict[str, list[float]] = {"padded": [], "varlen": []}
    cpu_times: dict[str, list[float]] = {"padded": [], "varlen": []}
    for i in range(1, n_batches):
        order = ("padded", "varlen") if i % 2 else ("varlen", "padded")
        for name in order:
            seconds, cpu = _step(models[name], opts[name], inputs[name][i], device, args.repeats)
            if i > args.warmup:
                times[name].append(seconds)
                cpu_times[name].append(cpu)

    timed = batches[args.warmup + 1 :]
    real = [sum(len(s["input_ids"]) for s in b) for b in timed]
    pad = [len(b) * max(len(s["input_ids"]) for s in b) for b in timed]
    paired = [tp / tv for tp, tv in zip(times["padded"], times["varlen"])]
    # per step: achieved / ideal for that batch; robust to load drift on a shared machine
    paired_fraction = [a / (p / r) for a, p, r in zip(paired, pad, real)]
    result = {
        "command": "slipstream bench varlen " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "varlen"] else sys.argv[1:]),
        "environment": _environment(device, dtype, torch.get_num_threads()),
        "model": args.model,
        "parameters": count_parameters(padded_model),
        "batch_size": args.batch_size,
        "steps": args.steps,
        "real_tokens_per_step_median": statistics.median(real),
        "padded_tokens_per_step_median": statistics.median(pad),
        "ideal_ratio": sum(pad) / sum(real),
        "achieved_ratio": sum(times["padded"]) / sum(times["varlen"]),
        "achieved_ratio_median_paired": statistics.median(paired),
        "achieved_ratio_cpu_time": sum(cpu_times["padded"]) / sum(cpu_times["varlen"]),
        "repeats": args.repeats,
        "fraction_of_ideal_median_paired": statistics.median(paired_fraction),
        "cases": {
            name: {
                "step_seconds_median": statistics.median(times[name]),
                "real_tokens_per_s": statistics.median(r / t for r, t in zip(real, times[name])),
                "padded_tokens_per_s": statistics.median(p / t for p, t in zip(pad, times[name])),
                "step_seconds": times[name],
                "step_cpu_seconds": cpu_times[name],
            }
            for name in times
        },
        "exactness": exact,
    }
    result["fraction_of_ideal"] = result["achieved_ratio"] / result["ideal_ratio"]
    table = _markdown(result)
    emit(table, result, args, indent=2)
    return 0


def _markdown(r: dict[str, Any]) -> str:
    e, x = r["environment"], r["exactness"]
    mem_label = "peak GPU memory of a step" if e["device"].startswith("cuda") else "activations saved for backward"
    mib = 2**20
    rows = [
        "| case | median step (s) | real tokens/s | padded tokens/s | memory (MiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("padded", "varlen"):
        c = r["cases"][name]
        rows.append(
            f"| {name} | {c['step_seconds_median']:.3f} | {c['real_tokens_per_s']:.0f} | "
            f"{c['padded_tokens_per_s']:.0f} | {x[f'memory_{name}_bytes'] / mib:.1f} |"
        )
    lines = [
        f"model {r['model']} ({r['parameters'] / 1e6:.1f}M parameters), batch {r['batch_size']}, "
        f"{r['steps']} timed steps per case (fastest of {r['repeats']}), {e['device']} {e['dtype']}, {e['torch_threads']} torch threads, "
        f"1-min load average at the end {e['load_average_1min_at_end']:.1f}",
        "",
        *rows,
        "",
        f"- real / padded tokens per step (median): {r['real_tokens_per_step_median']} / "
        f"{r['padded_tokens_per_step_median']}",
        f"- ideal ratio (padded tokens / real tokens): {r['ideal_ratio']:.3f}",
        f"- achieved ratio (padded time / varlen time): {r['achieved_ratio']:.3f} "
        f"(median of per-step pairs {r['achieved_ratio_median_paired']:.3f}); "
        f"{r['fraction_of_ideal']:.2f} x ideal (median per-step achieved/ideal: "
        f"{r['fraction_of_ideal_median_paired']:.2f}); by process CPU time {r['achieved_ratio_cpu_time']:.3f}",
        f"- loss padded {x['loss_padded']:.6f}, varlen {x['loss_varlen']:.6f}, relative diff {x['loss_rel_diff']:.2e}",
        f"- gradients: max abs diff {x['grad_max_abs_diff']:.2e} (max |grad| {x['grad_max_abs']:.2e}), "
        f"allclose(rtol=1e-4, atol=1e-6): {x['grads_allclose_rtol1e-4_atol1e-6']}",
        f"- memory column: {mem_label}",
        "",
    ]
    return "\n".join(lines)
