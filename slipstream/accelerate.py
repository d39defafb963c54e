"""``slipstream.accelerate.Accelerator``: ``accelerate.Accelerator`` with slipstream's FSDP
adapter installed (see ``slipstream.plugins.accelerate``)."""

from .plugins.accelerate import Accelerator, install, uninstall

__all__ = ["Accelerator", "install", "uninstall"]
