"""Megatron-core adapter: tensor- and data-parallel groups through the core and the compile
hook (``adapter.py``), and packed (THD) sequences for the local attention (``packed.py``).
Needs the ``megatron`` extra (``megatron-core``), imported lazily."""

from .adapter import (add_arguments, chain, disable_compile, enable_compile, install, name_backend, process_groups,
                      read_arguments, restore_process_groups, uninstall)
from ..._common import lazy
from .packed import disable_packed_attention, enable_packed_attention, local_spec, pack_batch, packed_attention

__all__ = ["PackedDotProductAttention", "add_arguments", "chain", "disable_compile", "disable_packed_attention",
           "enable_compile", "enable_packed_attention", "install", "local_spec", "name_backend", "pack_batch",
           "packed_attention", "process_groups", "read_arguments", "restore_process_groups", "uninstall"]


__getattr__, __dir__ = lazy.attributes(__name__, {"PackedDotProductAttention": ".packed"})  # built in packed.py
