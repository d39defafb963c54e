"""What every adapter does the same way: read the one ``SlipstreamConfig`` from the stack's
section, and apply the job-wide effects of its settings once per process."""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Mapping

from .config import SlipstreamConfig
from .._common import record
from .cpu_memory import keep_freed_memory, release_freed_memory

__all__ = ["apply_job_effects", "compile_model", "read_config", "undo_job_effects"]


def read_config(section: Mapping[str, Any] | None, where: str = "slipstream") -> SlipstreamConfig:
    """The stack's ``section`` (None: absent, so disabled) as a validated config, over
    ``slipstream.enable(config)``'s settings (``CommConfig.resolve``); errors name the key
    (``where`` is its path) or the variable."""
    return SlipstreamConfig.from_dict(section, where, code=record.switch.config)


def apply_job_effects(settings: SlipstreamConfig, *, on_cpu: bool) -> None:
    """Process-wide effects of ``settings``; idempotent, undone by ``undo_job_effects``."""
    if settings.keep_freed_memory and on_cpu:
        keep_freed_memory()


def undo_job_effects() -> None:
    release_freed_memory()


def compile_model(model, settings: SlipstreamConfig | None, group=None, steps: int | None = None,
                  micro_batches: int = 1) -> bool:
    """``slipstream.compile`` on the stack's model when the section has ``"compile"``; a
    wrapped model (DDP, FSDP2, a DeepSpeed engine's module) gets its hook-free regions.
    ``steps``: the run's length in optimizer steps where the stack knows it, each of
    ``micro_batches`` forward calls (the search's budget is a share of the run). Returns
    whether it was applied."""
    if settings is None or settings.compile is None or not settings.compile.enabled:
        return False
    from ..core_compile import compile as compile_

    config = settings.compile.with_run_length(steps, micro_batches)
    compile_(model, config=config, group=group)
    if config.expected_steps is None and "transformers.trainer_callback" in sys.modules:
        from .transformers import install

        install()  # a Hugging Face Trainer tells the run's length when training starts
    return True


def note_overlap_choice(stack: str, fact: str):
    """The ``on_decided`` of a stack's ``OverlapTrial``: once the trial decides, ``status()``'s
    record of ``stack`` says which (``fact``: True when overlapped) and why, and the log too."""
    return functools.partial(_noted_choice, stack, fact)


def _noted_choice(stack: str, fact: str, trial) -> None:
    record.update_stack(stack, **{fact: trial.choice, "overlap": trial.reason})
    logging.getLogger("slipstream").info("slipstream: %s", trial.reason)
