"""``slipstream.fsdp.apply(model)``: FSDP2's all-gathers and reduce-scatters through the core
(see ``slipstream.plugins.fsdp.comms``); ``remove(model)`` undoes it."""

from .plugins.fsdp.comms import apply, is_applied, remove

__all__ = ["apply", "is_applied", "remove"]
