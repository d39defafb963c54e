"""The varlen stage of ``slipstream bench gpu``: ``bench varlen`` at a GPU-bound size, once per
attention backend, and the model it runs.

The model is a Llama with grouped-query attention built from a ``LlamaConfig`` (``MODELS``),
random weights saved once into the run's work directory (``model_dir``), which ``bench
varlen`` and ``bench compile`` load as a local model (nothing is downloaded). Each backend is
one ``bench varlen`` run (padded, varlen with that backend and Hugging Face's flattening, in
turns): ``flash`` where flash-attn is installed and ``torch_varlen`` in this process; ``flex``
in a process of its own (``python -m slipstream.bench.workers.gpu_varlen -- <bench varlen
arguments>``), bounded by what is left of the stage's time: it compiles its kernels on CUDA (the
varlen pass runs FlexAttention compiled there), which may fail or run long without costing the
other rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

__all__ = ["MODELS", "config", "model_dir", "parameters", "stage"]

# name -> LlamaConfig fields. llama-150m: 153.0M parameters (32,000 x 768 embeddings and an
# untied head, 49.2M; 12 layers of 8.65M: q/o 768x768, k/v 768x256, MLP 3 x 768x3072).
MODELS = {
    "llama-150m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=4, vocab_size=32000),
    "llama-gqa-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=1024),
}


def config(name: str):
    """The ``LlamaConfig`` of model ``name``."""
    from transformers import LlamaConfig

    # the special tokens' ids of the bench's tokenizer (recipes.tokenizer.SPECIAL_TOKENS)
    return LlamaConfig(**MODELS[name], max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       tie_word_embeddings=False)


def parameters(name: str) -> int:
    """Parameters of model ``name``, from its shape (no model built): the embeddings and the
    untied head, per layer q/o (hidden x hidden), k/v (hidden x kv_heads x head_dim), the MLP's
    3 x hidden x intermediate and 2 norms, and the final norm."""
    c = MODELS[name]
    h, kv = c["hidden_size"], c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * c["intermediate_size"] + 2 * h
    return 2 * c["vocab_size"] * h + c["num_hidden_layers"] * layer + h


def model_dir(name: str, workdir: str) -> str:
    """A local model directory of ``name`` (seed 0, bf16 weights) under ``workdir``, made once."""
    path = Path(workdir) / name
    if not (path / "config.json").exists():
        from transformers import LlamaForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            LlamaForCausalLM(config(name)).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def _varlen_args(ctx: dict, model: str, backend: str, out: Path) -> list[str]:
    return ["--model", model, "--backend", backend, "--batch-size", str(ctx["batch_size"]), "--steps",
            str(ctx["steps"]), "--warmup", str(ctx["warmup"]), "--device", ctx["device"],
            "--dtype", "bf16" if ctx["device"] == "cuda" else "fp32", "--json", str(out),
            *(["--threads", str(ctx["threads"])] if ctx["threads"] else [])]


def _run_varlen(argv: list[str]) -> None:
    from slipstream.bench import varlen

    parser = argparse.ArgumentParser(prog="slipstream bench varlen")
    varlen.add_arguments(parser)
    varlen.run(parser.parse_args(argv))


def _backends(device: str) -> dict[str, str | None]:
    """For each backend timed on ``device``, None where it can train there in bf16, else why not."""
    from slipstream.core_compile.varlen.attention import resolve_backend

    if device != "cuda":
        return {"sdpa": None, "flex": "FlexAttention has no backward on CPU"}
    probe = torch.ones(1, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    why: dict[str, str | None] = {}
    for backend in ("flash", "torch_varlen", "flex"):
        try:
            resolve_backend(backend, probe)
            why[backend] = None
        except RuntimeError as e:
            why[backend] = str(e).split(": ", 1)[-1]
    return why


def stage(ctx: dict, rows, deadline: float) -> dict:
    """Rows: padded (the reference), each backend against it, Hugging Face's flattening."""
    model = model_dir(ctx["model"], ctx["workdir"])
    n, shape = parameters(ctx["model"]), MODELS[ctx["model"]]
    label = (f"{ctx['model']}: {n / 1e6:.1f}M parameters, {shape['num_attention_heads']} query / "
             f"{shape['num_key_value_heads']} key-value heads, {'bf16' if ctx['device'] == 'cuda' else 'fp32'}; "
             f"batch {ctx['batch_size']}")
    runs: dict[str, dict] = {}
    for backend, why in _backends(ctx["device"]).items():
        if why is not None:
            rows.add(f"varlen {backend}", "skipped", why)
            continue
        out = Path(ctx["workdir"]) / f"varlen-{backend}.json"
        argv = _varlen_args(ctx, model, backend, out)
        failure = _run_flex(argv, deadline) if backend == "flex" else _run_here(argv)
        if failure is not None:
            rows.add(f"varlen {backend}", "FAILED", failure)
            continue
        runs[backend] = json.loads(out.read_text())
        if len(runs) == 1:  # the references, from the first run
            _reference_rows(rows, runs[backend], label)
        rows.add(*_case_row(runs[backend], "varlen", f"varlen {backend}"))
        if ctx["device"] == "cuda":  # the next run's peak memory starts from nothing held
            gc.collect()
            torch.cuda.empty_cache()
    return {"model": ctx["model"], "parameters": n, "runs": runs}


def _run_here(argv: list[str]) -> str | None:
    """One ``bench varlen`` run in this process; why it failed, or None."""
    try:
        _run_varlen(argv)
    except Exception as e:  # noqa: BLE001 - one backend's failure is its row
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
    return None


FLEX_S = 45.0
"""The most a ``flex`` run may take. Its compiled step at 153M has never finished on a GPU: not
in 164 s on an H100 (2026-11-28), nor in 90 s on an H200 (2026-11-29 and 11-30); the time it
is not given goes to the stages after it."""


def _run_flex(argv: list[str], deadline: float) -> str | None:
    """One ``bench varlen`` run in a process of its own, within ``FLEX_S`` and the stage's time
    (FlexAttention compiles its kernels); why it failed, or None."""
    left = min(FLEX_S, deadline - time.monotonic() - 5)
    if left < 10:
        return f"not run: {max(left, 0):.0f} s left of the stage's time"
    try:
        done = subprocess.run([sys.executable, "-m", "slipstream.bench.workers.gpu_varlen", "--", *argv],
                              capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired as e:
        said = (e.stderr or b"").decode(errors="replace").strip().splitlines() if isinstance(e.stderr, bytes) \
            else (e.stderr or "").strip().splitlines()
        return f"timed out after {left:.0f} s" + (f"; its last line: {said[-1][:200]}" if said else "")
    sys.stdout.write(done.stdout[-4000:] + done.stderr[-4000:])
    if done.returncode != 0:
        return next((line for line in reversed(done.stderr.splitlines()) if line.strip()),
                    f"exit code {done.returncode}")[:300]
    return None


def _reference_rows(rows, run: dict, label: str) -> None:
    case, result, detail = _case_row(run, "padded", f"padded ({label})" if label else "padded")
    rows.add(case, result, f"{detail}; padding is {1 - 1 / run['ideal_ratio']:.0%} of the padded batch, so the "
                           f"token bound is {run['ideal_ratio']:.2f}x")
    rows.add(*_case_row(run, "hf_flatten", "Hugging Face DataCollatorWithFlattening"))


def _case_row(run: dict, name: str, case: str) -> tuple[str, str, str]:
    """(case, result, detail) of case ``name`` of a ``bench varlen`` record."""
    import statistics

    c, x = run["cases"][name], run["exactness"]["cases"][name]
    memory = "peak memory" if run["environment"]["device"].startswith("cuda") else "activations saved"
    cpu_ms = statistics.median(c["step_cpu_seconds"]) * 1e3
    detail = (f"{c['step_seconds_median'] * 1e3:.1f} ms/step, {c['real_tokens_per_s']:,.0f} real tokens/s, "
              f"{memory} {x['memory_bytes'] / 2**20:,.0f} MiB, host CPU {cpu_ms:.1f} ms/step")
    if name == "padded":
        return case, f"{c['step_seconds_median'] * 1e3:.1f} ms/step (the reference)", detail
    ratio = c["vs_padded"]["time_ratio"]
    return case, f"{ratio:.2f}x padded", f"{detail}; loss rel. diff {x['loss_rel_diff']:.1e} from padded"


def _main() -> None:
    """``-- <bench varlen arguments>``: one ``bench varlen`` run in this process."""
    if sys.argv[1:2] != ["--"]:
        raise SystemExit("usage: python -m slipstream.bench.workers.gpu_varlen -- <bench varlen arguments>")
    _run_varlen(sys.argv[2:])


if __name__ == "__main__":
    _main()
