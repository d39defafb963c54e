"""The Hugging Face Trainer tells ``slipstream.compile`` how long the run is.

The Trainer knows the run's length (``max_steps``, or the epochs' update steps; less the
steps done when it resumes from a checkpoint) only inside ``train()``, after it prepared the
model, which is where the stacks' adapters compile it. One reversible patch, of
``CallbackHandler.on_train_begin`` (called after that, before the first step), gives it, times
``gradient_accumulation_steps`` (a forward call per micro-batch), to the autotuners of the
Trainer's model that neither the user nor a stack told (``tell_run_length``). TRL's trainers
are Trainers, so they tell it too.

Installed by ``slipstream.enable()`` when transformers is imported, and by a stack's adapter
that compiled a model without a run length while transformers was imported. Waits for
``transformers.trainer_callback`` to be imported, never importing it first.
"""

from __future__ import annotations

import functools
import sys

from slipstream_after_import import AfterImport

from ..._common.patch import patch, uninstall_all
from ..._common.record import note_stack

__all__ = ["install", "uninstall"]

_OWNER = "transformers"
_MODULE = "transformers.trainer_callback"


def install() -> None:
    """Idempotent; ``uninstall`` undoes it exactly."""
    if _MODULE in sys.modules:
        _patch(_MODULE)
    elif not any(isinstance(f, _Waiting) for f in sys.meta_path):
        sys.meta_path.insert(0, _Waiting({_MODULE}, _patch))


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Waiting)]
    uninstall_all(_OWNER)


class _Waiting(AfterImport):
    """Patches the callback handler once transformers has imported its module."""


def _patch(_name: str) -> None:
    from transformers.trainer_callback import CallbackHandler

    original = CallbackHandler.on_train_begin

    @functools.wraps(original)
    def on_train_begin(self, args, state, control, **kwargs):
        # the steps left: a run resumed from a checkpoint starts at its global step
        tell(getattr(self, "model", None), state.max_steps - state.global_step, args.gradient_accumulation_steps)
        return original(self, args, state, control, **kwargs)

    patch(CallbackHandler, "on_train_begin", on_train_begin, owner=_OWNER)


def tell(model, steps, accumulation) -> int:
    """The run's length to the autotuners in ``model`` not told one; how many were told."""
    from ...core_compile.autotune.api import tell_run_length

    told = tell_run_length(model, steps, accumulation) if model is not None else 0
    if told:
        note_stack("transformers", compile_run_length=f"{steps * accumulation} forward calls (the Trainer's {steps} "
                                                      f"steps left x gradient_accumulation_steps {accumulation}), "
                                                      f"told to {told} compiled module(s)")
    return told
