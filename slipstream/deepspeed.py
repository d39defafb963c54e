"""``slipstream.deepspeed.initialize``: a drop-in for ``deepspeed.initialize`` (see
``slipstream.plugins.deepspeed``)."""

from .plugins.deepspeed import initialize, install, uninstall

__all__ = ["initialize", "install", "uninstall"]
