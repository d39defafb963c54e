"""``slipstream bench compile``: what ``slipstream.compile`` chooses, and what a whole run
with it on costs or gains against eager, on three training loops.

Models (``--models``), each trained with forward + backward + optimizer step and its own loss:

- ``resnet50``: ResNet-50 (torchvision's when it imports, else ``workers/resnet.py``, the same
  architecture; the report says which) on random ``(batch, 3, size, size)`` images, 10
  classes, cross-entropy, SGD with momentum;
- ``bert``: ``BertForSequenceClassification``, random init, a BERT size from
  ``workers.compile.BERT_SIZES`` (``--bert-size``), fixed-shape batches of random token ids,
  AdamW;
- ``llama``: the recipe's ``llama-20m`` with ``apply_varlen`` on ``FlattenCollator`` batches of
  alpaca samples (generated, or ``--data``): a packed row whose length changes every step.

Each (model, device) runs in a fresh process (``workers/compile.py``) with an empty inductor
cache directory and the decision cache off, so compile times are cold: a whole run of
``--steps`` steps eagerly and the same run under ``slipstream.compile`` told its length
(``expected_steps``), from one seed on the same batches: eager's first half, the compile-on
run, eager's second half (``workers/compile.py``). The table
gives each run's wall time (the sum of its steps) and their ratio, the chosen strategy's step
time against eager's after the choice, what the search cost (its steps' time beyond the same
eager steps) as a share of the eager run, the step where the report says it pays for itself,
and how far the losses are from eager's. The candidate table gives every strategy the
autotuner considered.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile

import torch

from slipstream.cluster.worker import flags
from slipstream.core_compile import BACKENDS
from .report import emit, page, table
from .workers.compile import BERT_SIZES, WORKLOADS

__all__ = ["BACKGROUND", "GOALS", "add_arguments", "run"]

BACKGROUND = {"auto": None, "on": True, "off": False}
"""``--background`` -> ``CompileConfig.background``."""

GOALS = {"run_eager_chosen": 1.03, "run_candidate_chosen": 1.00, "search_share": 0.10, "speedup": 1.3,
         "speedup_models": 2}
"""Whole run with compile on / eager: at most 1.03 where eager is chosen, at most 1.00 where a
candidate is; the search's cost at most 10% of the eager run; on a GPU, the chosen strategy
1.3x eager's steps on at least two models."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="resnet50,bert,llama", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: CPU rows, and CUDA rows too when a GPU is present")
    parser.add_argument("--steps", type=int, default=200, help="steps of each whole run (default 200)")
    parser.add_argument("--expected-steps", type=int,
                        help="CompileConfig.expected_steps (default: --steps; 0: the run's length not told)")
    parser.add_argument("--batch-size", type=int, default=8, help="images, sequences or samples per step (default 8)")
    parser.add_argument("--budget-s", type=float, default=600.0, help="CompileConfig.budget_s (default 600)")
    parser.add_argument("--strategies", help="CompileConfig.strategies, comma-separated (default: all that apply)")
    parser.add_argument("--threads", type=int,
                        help="torch threads of each model's process (default: torch's own, one per core); "
                             "fewer than the cores leaves one to a compile process (--background)")
    parser.add_argument("--background", default="auto", choices=list(BACKGROUND),
                        help="CompileConfig.background: auto (None, the default), on (True), off (False)")
    parser.add_argument("--image-size", type=int, default=64, help="ResNet-50 image side (default 64)")
    parser.add_argument("--resnet-width", type=int, default=64, help="ResNet-50 base width (default 64, ResNet-50's)")
    parser.add_argument("--bert-size", default="mini", choices=list(BERT_SIZES),
                        help="layers x hidden: " + ", ".join(f"{k} {l}x{h}" for k, (l, h) in BERT_SIZES.items())
                             + " (default mini: base's step takes ~10 s on 2 cores)")
    parser.add_argument("--seq-len", type=int, default=128, help="BERT tokens per sequence (default 128)")
    parser.add_argument("--llama-model", default="llama-20m", help="recipe model name (default llama-20m)")
    parser.add_argument("--varlen-backend", default="auto", choices=["auto", *BACKENDS],
                        help="llama's varlen attention backend, VarlenConfig.backend (default auto)")
    parser.add_argument("--data", help="alpaca-format JSON for llama (default: 1000 generated samples)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per model before it is killed")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--markdown", help="write the report here")


def _command(args: argparse.Namespace) -> str:
    parts = ["slipstream bench compile", *flags(args, "models", "device", "steps", "expected_steps", "batch_size",
                                                 "threads"),
             f"--budget-s {args.budget_s:g}", *flags(args, "strategies"),
             *(["--background", args.background] if args.background != "auto" else [])]
    models = args.models.split(",")
    for model, names in (("resnet50", ("image_size", "resnet_width")), ("bert", ("bert_size", "seq_len")),
                         ("llama", ("llama_model", "data"))):
        parts += flags(args, *names) if model in models else []
    if "llama" in models and args.varlen_backend != "auto":
        parts += ["--varlen-backend", args.varlen_backend]
    return " ".join(parts)


def _job(args: argparse.Namespace, model: str, device: str) -> dict:
    return {"model": model, "device": device, "steps": args.steps, "expected_steps": args.expected_steps,
            "batch_size": args.batch_size, "budget_s": args.budget_s, "seed": args.seed,
            "background": BACKGROUND[args.background], "threads": args.threads,
            "strategies": args.strategies.split(",") if args.strategies else None,
            "image_size": args.image_size, "resnet_width": args.resnet_width, "bert_size": args.bert_size,
            "seq_len": args.seq_len, "llama_model": args.llama_model, "data": args.data,
            "varlen_backend": args.varlen_backend}


def _run_job(job: dict, tmp: str, timeout: float) -> dict:
    """The worker's record; on failure ``{"model", "device", "error"}`` with its stderr's tail."""
    name = f"{job['model']}-{job['device']}"
    out, log = os.path.join(tmp, f"{name}.json"), os.path.join(tmp, f"{name}.log")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, f"inductor-{name}"),
               TRITON_CACHE_DIR=os.path.join(tmp, f"triton-{name}"),
               SLIPSTREAM_COMPILE_DIR=os.path.join(tmp, f"decisions-{name}"))
    cmd = [sys.executable, "-m", "slipstream.bench.workers.compile", "--job", json.dumps(job), "--out", out]
    with open(log, "w") as stderr:
        # its own session: on a timeout the worker goes with inductor's compile processes, which
        # would otherwise go on writing into the cache directory being removed
        proc = subprocess.Popen(cmd, env=env, stdout=stderr, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # not reaped yet: the group is still the worker's
            proc.wait()
            rc = f"killed after {timeout:g} s"
    if rc == 0:
        with open(out) as f:
            return json.load(f)
    with open(log, errors="replace") as f:
        tail = f.read()[-2000:]
    return {"model": job["model"], "device": job["device"], "error": f"worker exit {rc}: {tail}"}


def _summary(r: dict) -> dict:
    """Whole runs, the steady state after the choice, the search's cost, the losses' distance."""
    eager, tuned, rep = r["eager_s"], r["tuned_s"], r["report"]
    searched = rep["decided_at_step"] - 1 if rep["decided_at_step"] else len(tuned)
    pairs = [e / t for e, t in zip(eager[searched:], tuned[searched:])]
    cost = sum(tuned[:searched]) - sum(eager[:searched])
    losses = [abs(t - e) / max(abs(e), 1e-12) for e, t in zip(r["eager_losses"], r["tuned_losses"])]
    return {
        "eager_run_s": sum(eager), "tuned_run_s": sum(tuned), "run_ratio": sum(tuned) / sum(eager),
        "ratio": statistics.median(pairs) if pairs else None, "search_cost_s": cost,
        "search_share": max(cost, 0.0) / sum(eager), "loss_rel_diff": max(losses),
    }


def _rows(records: list[dict]) -> list[str]:
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["model"], r["device"], "FAILED", *["-"] * 8])
            continue
        s, rep = r["summary"], r["report"]
        compiled = sum(c["graphs"] > 0 or c["compile_s"] > 0 for c in rep["candidates"])
        rows.append([r["model"], r["device"], f"{rep['chosen']} ({rep['decided_at_step']})",
                     f"{s['eager_run_s']:.1f}", f"{s['tuned_run_s']:.1f}", f"{s['run_ratio']:.3f}",
                     f"{s['ratio']:.2f}x" if s["ratio"] else "-",
                     f"{s['search_cost_s']:.1f} ({100 * s['search_share']:.1f}%)",
                     rep.get("break_even_step") or "-", compiled, f"{s['loss_rel_diff']:.1e}"])
    return table(["model", "device", "chosen (at step)", "eager run s", "compile-on run s", "run ratio",
                  "steps after the choice", "search cost s (share)", "pays back at step", "compiled",
                  "loss rel. diff"], "llrrrrrrrrr", rows)


def _candidate_rows(records: list[dict]) -> list[str]:
    rows = [[r["model"], r["device"], c["name"], c["status"],
             f"{c['step_ms']:.1f}" if c["step_ms"] is not None else "-",
             f"{c['speedup']:.2f}x" if c["speedup"] is not None else "-", f"{c['compile_s']:.1f}", c["graphs"],
             "; ".join(filter(None, (c["reason"], c.get("beside")))).replace("|", "/")[:240]]
            for r in records for c in r.get("report", {}).get("candidates", [])]
    return table(["model", "device", "strategy", "status", "step ms", "vs eager", "compile s", "graphs", "note"],
                 "llllrrrrl", rows)


def _goals(records: list[dict], device: str) -> str:
    done = [r for r in records if r["device"] == device and "error" not in r]
    if not done:
        return f"goals ({device}): no model finished"

    def over(r) -> bool:
        bound = GOALS["run_eager_chosen"] if r["report"]["chosen"] == "eager" else GOALS["run_candidate_chosen"]
        return r["summary"]["run_ratio"] > bound

    def verdict(bad: list) -> str:
        return "met" if not bad else "MISSED (" + ", ".join(bad) + ")"

    slow = [f"{r['model']} {r['summary']['run_ratio']:.3f}" for r in done if over(r)]
    costly = [f"{r['model']} {100 * r['summary']['search_share']:.1f}%" for r in done
              if r["summary"]["search_share"] > GOALS["search_share"]]
    line = (f"goals ({device}): whole run <= {GOALS['run_eager_chosen']}x eager's where eager is chosen, "
            f"<= {GOALS['run_candidate_chosen']:.2f}x where a candidate is: {verdict(slow)}; search cost "
            f"<= {100 * GOALS['search_share']:.0f}% of the run: {verdict(costly)}")
    if device == "cuda":
        fast = [r["model"] for r in done if (r["summary"]["ratio"] or 0) >= GOALS["speedup"]]
        line += (f"; >= {GOALS['speedup']}x eager's steps on >= {GOALS['speedup_models']} models: "
                 f"{'met' if len(fast) >= GOALS['speedup_models'] else 'MISSED'} ({', '.join(fast) or 'none'})")
    return line


def _report(records: list[dict], devices: list[str], command: str) -> str:
    from transformers import __version__ as transformers_version

    notes = ["cold compiles: each model in a fresh process with an empty TORCHINDUCTOR_CACHE_DIR; "
             "CompileConfig(cache=False) and an empty SLIPSTREAM_COMPILE_DIR (no decision reused)",
             "run s: the sum of a whole run's steps (forward + backward + optimizer step), on the same batches: "
             "eager's first half, the compile-on run, eager's second half; run ratio: compile-on / eager; "
             "steps after the choice: median of "
             "eager / chosen step time over the pairs after the choice; search cost: the search's steps' time "
             "beyond the same eager steps, its share of the eager run; pays back at step: the report's "
             "break-even (- where eager is chosen)"]
    lines = [f"- {r['model']} ({r['device']}): " + (f"{r['description']}; {r['parameters'] / 1e6:.1f} M parameters; "
                                                   f"batch {r['batch']}; {r['torch_threads']} torch threads"
                                                   if "error" not in r else "FAILED")
             for r in records]
    lines += ["", *_rows(records), "", *_candidate_rows(records), ""]
    lines += [_goals(records, d) for d in devices]
    if "cuda" not in devices:
        lines.append("GPU rows: skipped (no CUDA device)" if not torch.cuda.is_available()
                     else "GPU rows: skipped (--device cpu)")
    lines += [f"\n{r['model']} ({r['device']}) failed:\n{r['error']}" for r in records if "error" in r]
    lines.append(f"1-min load average at the end: {os.getloadavg()[0]:.1f}")
    return page(command, notes, lines, f"transformers {transformers_version}")


def _devices(choice: str) -> list[str]:
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    if choice == "auto":
        return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    return [choice]


def run(args: argparse.Namespace) -> int:
    models = args.models.split(",")
    unknown = [m for m in models if m not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown model {unknown[0]!r}; known: {', '.join(WORKLOADS)}")
    if args.steps < 1 or args.batch_size < 1 or (args.expected_steps or 0) < 0:
        raise SystemExit("--steps and --batch-size must be >= 1, --expected-steps >= 0")
    if args.strategies:
        from slipstream.core_compile.autotune.strategy import candidates

        try:
            candidates("cpu", names=args.strategies.split(","))
        except ValueError as e:
            raise SystemExit(f"--strategies: {e}") from e
    devices = _devices(args.device)
    command = _command(args)
    sys.stdout.write(command + "\n")
    records = []
    with tempfile.TemporaryDirectory(prefix="slipstream-bench-compile-", ignore_cleanup_errors=True) as tmp:
        for device in devices:
            for model in models:
                r = _run_job(_job(args, model, device), tmp, args.timeout)
                if "error" not in r:
                    r["summary"] = _summary(r)
                records.append(r)
    emit(_report(records, devices, command), records, args)
    return 1 if any("error" in r for r in records) else 0
