"""One model of ``slipstream bench compile``, in a process of its own.

``compile.py`` starts one per (model, device) with an empty ``TORCHINDUCTOR_CACHE_DIR``, so
every compile is cold and no inductor state crosses models. Two copies of the model, built
from one seed, each train a whole run of ``steps`` steps on the same batches (forward +
backward + optimizer step, the model's own loss):

- ``eager``: the model as it is;
- ``tuned``: ``slipstream.compile(model, config=CompileConfig(cache=False, expected_steps=...))``:
  its search, then the chosen strategy.

Their steps cannot take turns, since the autotuner times a step as the time between two calls
of the model's forward. So the eager run takes its first half of the steps, the compile-on run
all of its steps, then the eager run its second half: a drift of the machine's speed over the
measurement weighs on both runs alike. Each run's wall time is the sum of its steps. Before them, a third copy takes ``WARM_STEPS`` untimed steps, so
neither run pays for the process's first use of its kernels. The result: both runs' step times and losses, and
``compile_report(model).to_dict()``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import torch

from slipstream.cluster.worker import run_worker, timed_step

WARM_STEPS = 2

# name -> (layers, hidden): Google's BERT miniatures (Turc et al., 2019) and BERT-base
BERT_SIZES = {"tiny": (2, 128), "mini": (4, 256), "small": (4, 512), "medium": (8, 512), "base": (12, 768)}


@dataclass
class Workload:
    description: str
    build: Callable[[], torch.nn.Module]
    """A fresh model from the job's seed, on the device, in training mode."""
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]
    batches: list
    """Cycled through; step ``i`` of both copies takes ``batches[i % len(batches)]``."""
    loss: Callable[[torch.nn.Module, object], torch.Tensor]
    batch_shape: str


def _seeded(make, seed: int):
    def build():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return make()
    return build


def _resnet_factory(width: int):
    """(make, where it comes from): torchvision's ResNet-50 when it imports, else ours."""
    why = f"--resnet-width {width}, torchvision's is 64"
    if width == 64:
        try:
            import torchvision

            return lambda: torchvision.models.resnet50(num_classes=10), "torchvision.models.resnet50"
        except Exception as e:  # noqa: BLE001 - a CUDA-only torchvision fails in its _C, not at import
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    from .resnet import resnet50

    return (lambda: resnet50(num_classes=10, width=width),
            f"slipstream.bench.workers.resnet (torchvision's architecture; torchvision not used: {why})")


def _resnet(job: dict, device: torch.device) -> Workload:
    """ResNet-50 on random (batch, 3, size, size) images of 10 classes, cross-entropy, SGD."""
    make, source = _resnet_factory(job["resnet_width"])
    b, s = job["batch_size"], job["image_size"]
    g = torch.Generator().manual_seed(job["seed"])
    batches = [(torch.randn(b, 3, s, s, generator=g).to(device), torch.randint(0, 10, (b,), generator=g).to(device))
               for _ in range(8)]
    return Workload(description=f"ResNet-50 from {source}, width {job['resnet_width']}",
                    build=_seeded(lambda: make().to(device).train(), job["seed"]),
                    optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9), batches=batches,
                    loss=lambda m, batch: torch.nn.functional.cross_entropy(m(batch[0]), batch[1]),
                    batch_shape=f"{b} x 3 x {s} x {s}")


def _bert(job: dict, device: torch.device) -> Workload:
    """BertForSequenceClassification (random init, BERT's dropout) on random token ids, AdamW."""
    from transformers import BertConfig, BertForSequenceClassification

    layers, hidden = BERT_SIZES[job["bert_size"]]
    config = BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=max(hidden // 64, 1),
                        intermediate_size=4 * hidden, num_labels=2)
    b, n = job["batch_size"], job["seq_len"]
    g = torch.Generator().manual_seed(job["seed"])
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (b, n), generator=g).to(device),
                "attention_mask": torch.ones(b, n, dtype=torch.long, device=device),
                "labels": torch.randint(0, 2, (b,), generator=g).to(device)} for _ in range(8)]
    return Workload(description=f"BertForSequenceClassification, bert-{job['bert_size']} ({layers} layers, hidden "
                                f"{hidden}), {config._attn_implementation or 'default'} attention",
                    build=_seeded(lambda: BertForSequenceClassification(config).to(device).train(), job["seed"]),
                    optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4), batches=batches,
                    loss=lambda m, batch: m(**batch).loss, batch_shape=f"{b} x {n} tokens")


def _llama(job: dict, device: torch.device) -> Workload:
    """The recipe's llama on alpaca samples, varlen pass + ``FlattenCollator`` (one packed row
    per step, its length changing every step), AdamW."""
    from slipstream.core_compile import FlattenCollator, VarlenConfig, apply_varlen
    from slipstream.recipes import build_model, load_tokenizer
    from slipstream.recipes.alpaca import alpaca_samples

    tokenizer = load_tokenizer(vocab_size=8192)
    samples, _ = alpaca_samples(tokenizer, data=job["data"], seed=job["seed"], max_length=2048, shuffle=True)
    b = job["batch_size"]
    n = min(len(samples) // b, job["steps"])
    if n < 1:
        raise SystemExit(f"need at least {b} samples, have {len(samples)}")
    collate = FlattenCollator()
    batches = [{k: v.to(device) if isinstance(v, torch.Tensor) else v
                for k, v in collate(samples[i * b:(i + 1) * b]).items()} for i in range(n)]
    tokens = sorted(batch["input_ids"].shape[1] for batch in batches)

    backend = job.get("varlen_backend", "auto")

    def make():
        model = build_model(job["llama_model"], vocab_size=max(8192, len(tokenizer)), seed=job["seed"],
                            pad_token_id=tokenizer.pad_token_id)
        return apply_varlen(model.to(device).train(), VarlenConfig(backend=backend))

    named = f" (backend {backend})" if backend != "auto" else ""
    data = "from " + job["data"] if job["data"] else "generated"
    return Workload(description=f"{job['llama_model']} (recipe model) with apply_varlen{named}, FlattenCollator "
                                f"batches of {b} alpaca samples ({data})",
                    build=make, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4), batches=batches,
                    loss=lambda m, batch: m(**batch).loss,
                    batch_shape=f"1 x {tokens[0]}..{tokens[-1]} tokens (median {tokens[len(tokens) // 2]})")


WORKLOADS = {"resnet50": _resnet, "bert": _bert, "llama": _llama}


def measure(job: dict) -> dict:
    import slipstream
    from slipstream import CompileConfig

    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    device = torch.device(job["device"])
    w = WORKLOADS[job["model"]](job, device)
    warm, eager, tuned = w.build(), w.build(), w.build()

    def step(model, opt, i: int) -> tuple[float, float]:
        """(seconds, loss) of step ``i``: forward + backward + optimizer step on batch ``i`` (cycled),
        random draws (dropout) seeded by ``i``, so both runs' step ``i`` draw alike."""
        losses = []
        torch.manual_seed(job["seed"] * 1_000_003 + i)

        def loss():
            value = w.loss(model, w.batches[i % len(w.batches)])
            losses.append(value.detach())
            return value
        return timed_step(loss, opt, device)[0], float(losses[-1])

    warm_opt = w.optimizer(warm)
    for i in range(WARM_STEPS):
        step(warm, warm_opt, i)
    del warm, warm_opt
    expected = job["expected_steps"] if job["expected_steps"] is not None else job["steps"]
    config = CompileConfig(cache=False, verbose=False, budget_s=job["budget_s"], expected_steps=expected or None,
                           background=job.get("background"),
                           strategies=tuple(job["strategies"]) if job["strategies"] else None)
    slipstream.compile(tuned, config=config)
    runs = {"eager": (eager, w.optimizer(eager), []), "tuned": (tuned, w.optimizer(tuned), [])}
    half = job["steps"] // 2
    for name, steps in (("eager", range(half)), ("tuned", range(job["steps"])), ("eager", range(half, job["steps"]))):
        model, opt, record = runs[name]
        record.extend(step(model, opt, i) for i in steps)
    report = slipstream.compile_report(tuned)
    return {
        "model": job["model"], "device": str(device), "description": w.description, "batch": w.batch_shape,
        "parameters": sum(p.numel() for p in tuned.parameters()), "torch_threads": torch.get_num_threads(),
        "eager_s": [t for t, _ in runs["eager"][2]], "tuned_s": [t for t, _ in runs["tuned"][2]],
        "eager_losses": [v for _, v in runs["eager"][2]], "tuned_losses": [v for _, v in runs["tuned"][2]],
        "report": report.to_dict(), "report_table": report.table(),
    }

if __name__ == "__main__":
    # --job: the job as JSON (compile._job). A process of its own, no group: every core is the
    # model's (torch's own thread count).
    run_worker(lambda args: measure(json.loads(args.job)), options={"--job": str}, group=None, threads=None)
