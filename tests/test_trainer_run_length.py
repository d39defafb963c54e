"""The Hugging Face Trainer tells ``slipstream.compile`` the run's length: its steps left times
its gradient accumulation, in forward calls, before the first step (the transformers adapter)."""

from __future__ import annotations

import pytest
import torch

import slipstream
from slipstream import CompileConfig
from slipstream.recipes.model import build_model

transformers = pytest.importorskip("transformers")

VOCAB = 61


def _train(tmp_path, model, *, max_steps: int, accumulation: int) -> None:
    gen = torch.Generator().manual_seed(2)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(1, VOCAB, (32, 12), generator=gen)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=accumulation,
        max_steps=max_steps, learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
        dataloader_num_workers=0, logging_steps=1000)
    transformers.Trainer(model=model, args=args, train_dataset=data).train()


def _compiled(tmp_path, **kw):
    model = build_model("llama-tiny", vocab_size=VOCAB, seed=1)
    return slipstream.compile(model, config=CompileConfig(cache=False, verbose=False, background=False, **kw))


def test_the_trainer_tells_the_search_its_steps_times_the_accumulation(tmp_path):
    from transformers.trainer_callback import CallbackHandler

    from slipstream.plugins import transformers as adapter

    stock = CallbackHandler.on_train_begin
    adapter.install()
    try:
        adapter.install()  # again: one patch
        model = _compiled(tmp_path)
        _train(tmp_path, model, max_steps=3, accumulation=2)
        report = slipstream.compile_report(model)
        # 6 forward calls: steps 2 and 3 time eager; 5% of 6 steps pays for no compile, so the
        # search ends at step 4 with every compiled candidate skipped for its expected compile
        assert report.expected_steps == 6 and "of 6 steps" in report.budget_basis, report
        assert report.chosen == "eager" and report.decided_at_step == 4, report
        by_name = {c.name: c for c in report.candidates}
        assert all(c.status == "skipped" for n, c in by_name.items() if n != "eager"), report
        assert "expected compile" in by_name["inductor"].reason, report
        told = slipstream.status()["stacks"]["transformers"]["compile_run_length"]
        assert told.startswith("6 forward calls (the Trainer's 3 steps left x gradient_accumulation_steps 2)"), told

        mine = _compiled(tmp_path, expected_steps=50)  # the user's own length holds
        _train(tmp_path, mine, max_steps=3, accumulation=2)
        assert slipstream.compile_report(mine).expected_steps == 50
    finally:
        adapter.uninstall()
    assert CallbackHandler.on_train_begin is stock
    untold = _compiled(tmp_path, strategies=())  # no candidate: nothing to compile
    _train(tmp_path, untold, max_steps=1, accumulation=2)
    assert slipstream.compile_report(untold).expected_steps is None
