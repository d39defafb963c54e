"""Hugging Face Trainer adapter (TRL's trainers too): the run's length for ``slipstream.compile``
(see ``adapter``)."""

from .adapter import install, uninstall

__all__ = ["install", "uninstall"]
