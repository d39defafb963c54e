"""Megatron-core adapter: tensor- and data-parallel groups through the core and the compile
hook (``adapter.py``), and packed (THD) sequences for the local attention (``packed.py``).
Needs the ``megatron`` extra (``megatron-core``), imported lazily."""

from .adapter import (add_arguments, chain, disable_compile, enable_compile, install, name_backend, process_groups,
                      read_arguments, restore_process_groups, uninstall)
from .packed import disable_packed_attention, enable_packed_attention, local_spec, pack_batch, packed_attention

__all__ = ["PackedDotProductAttention", "add_arguments", "chain", "disable_compile", "disable_packed_attention",
           "enable_compile", "enable_packed_attention", "install", "local_spec", "name_backend", "pack_batch",
           "packed_attention", "process_groups", "read_arguments", "restore_process_groups", "uninstall"]


def __getattr__(name: str):
    if name == "PackedDotProductAttention":  # a subclass of megatron's: built on first use
        from .packed import _packed_class

        return _packed_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
