"""Megatron-core adapter: tensor- and data-parallel groups through the core (see
``adapter.py``). Needs the ``megatron`` extra (``megatron-core``), imported lazily."""

from .adapter import add_arguments, chain, initialize, install, process_groups, restore_process_groups, uninstall

__all__ = ["add_arguments", "chain", "initialize", "install", "process_groups", "restore_process_groups",
           "uninstall"]
