"""accelerate adapter: models accelerate prepares with FSDP2 get slipstream's collectives (and
the varlen pass), with the script and accelerate YAML users have (see ``adapter``)."""

from .adapter import Accelerator, install, uninstall

__all__ = ["Accelerator", "install", "uninstall"]
