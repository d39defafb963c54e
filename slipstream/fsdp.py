"""``slipstream.fsdp.apply(model)``: FSDP2's all-gathers and reduce-scatters through the core
(see ``slipstream.plugins.fsdp.fsdp2``); ``remove(model)`` undoes it."""

from .plugins.fsdp.fsdp2 import apply, is_applied, remove

__all__ = ["apply", "is_applied", "remove"]
