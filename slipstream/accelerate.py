"""``slipstream.accelerate.Accelerator``: ``accelerate.Accelerator`` with slipstream's FSDP
adapter installed (see ``slipstream.plugins.fsdp.accelerate``)."""

from .plugins.fsdp.accelerate import Accelerator, install, uninstall

__all__ = ["Accelerator", "install", "uninstall"]
