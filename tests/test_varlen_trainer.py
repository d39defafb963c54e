"""The flatten collator + varlen pass inside the stock Hugging Face Trainer: same training."""

from __future__ import annotations

import pytest
import torch

from _adam import assert_close_through_adam
from slipstream.core_compile import FlattenCollator, apply_varlen
from slipstream.recipes.model import build_model

VOCAB = 71
LENGTHS = [9, 30, 2, 17, 25, 4, 12, 1, 20, 6, 14, 28, 3, 11, 19, 8]


def _dataset():
    gen = torch.Generator().manual_seed(5)
    out = []
    for n in LENGTHS:
        ids = torch.randint(1, VOCAB, (n,), generator=gen)
        labels = ids.clone()
        labels[: n // 3] = -100  # a masked prompt
        out.append({"input_ids": ids, "labels": labels})
    return out


def _pad(features):
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = f["input_ids"], f["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _train(tmp_path, varlen):
    transformers = pytest.importorskip("transformers")
    model = build_model("llama-tiny", vocab_size=VOCAB, seed=3)
    if varlen:
        apply_varlen(model)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("varlen" if varlen else "padded")),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=11,
        dataloader_num_workers=0,
    )
    collate = FlattenCollator() if varlen else _pad
    grads: list = []

    class Gradients(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            grads.append([p.grad.detach().clone() for p in model.parameters()])

    trainer = transformers.Trainer(model=model, args=args, train_dataset=_dataset(), data_collator=collate,
                                   callbacks=[Gradients()])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_trainer_with_flatten_collator_matches_padded_training(tmp_path, monkeypatch):
    from slipstream.core_compile.varlen import hf_model as varlen_module

    calls = []
    real = varlen_module.varlen_attention
    monkeypatch.setattr(varlen_module, "varlen_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    padded_losses, padded_grads, padded_weights = _train(tmp_path, varlen=False)
    assert not calls
    varlen_losses, varlen_grads, varlen_weights = _train(tmp_path, varlen=True)
    assert len(calls) == 2 * 2 * 2  # steps x micro-steps x layers
    assert len(varlen_losses) == len(padded_losses) == 2
    torch.testing.assert_close(varlen_losses, padded_losses, rtol=1e-5, atol=1e-6)
    names = list(padded_weights)
    assert_close_through_adam([varlen_weights[n] for n in names], [padded_weights[n] for n in names],
                              varlen_grads, padded_grads, lr=1e-3, names=names)


def _evaluate(tmp_path, varlen):
    """``Trainer.evaluate`` with a token-accuracy ``compute_metrics`` (needs the logits in the
    labels' layout), on padded batches."""
    transformers = pytest.importorskip("transformers")
    model = build_model("llama-tiny", vocab_size=VOCAB, seed=3)
    if varlen:
        apply_varlen(model)  # the default logits layout: padded wherever a caller reads them

    def token_accuracy(pred):
        logits, labels = pred.predictions, pred.label_ids
        logits = logits[0] if isinstance(logits, tuple) else logits
        hit = logits[:, :-1].argmax(-1) == labels[:, 1:]
        real = labels[:, 1:] != -100
        return {"accuracy": float((hit & real).sum() / real.sum()), "logits_shape": str(logits.shape)}

    args = transformers.TrainingArguments(output_dir=str(tmp_path / f"eval-{varlen}"), per_device_eval_batch_size=4,
                                          report_to=[], use_cpu=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, eval_dataset=_dataset(), data_collator=_pad,
                                   compute_metrics=token_accuracy)
    return trainer.evaluate()


def test_evaluate_with_compute_metrics_sees_padded_logits_and_equals_stock(tmp_path):
    ours, ref = _evaluate(tmp_path, varlen=True), _evaluate(tmp_path, varlen=False)
    assert ours["eval_logits_shape"] == ref["eval_logits_shape"]
    assert ours["eval_accuracy"] == ref["eval_accuracy"]
    assert ours["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
