"""``slipstream.megatron``: Megatron-LM's ``--slipstream`` flags, Megatron-core's groups on
the core, the compile hook, and packed (THD) sequences for the local attention (see
``slipstream.plugins.megatron``)."""

from .plugins.megatron import (
    add_arguments,
    chain,
    disable_compile,
    disable_packed_attention,
    enable_compile,
    enable_packed_attention,
    initialize,
    local_spec,
    pack_batch,
    packed_attention,
    process_groups,
    restore_process_groups,
)

__all__ = ["PackedDotProductAttention", "add_arguments", "chain", "disable_compile", "disable_packed_attention",
           "enable_compile", "enable_packed_attention", "initialize", "local_spec", "pack_batch", "packed_attention", "process_groups",
           "restore_process_groups"]


def __getattr__(name: str):
    if name == "PackedDotProductAttention":  # a subclass of megatron's: built on first use
        from .plugins.megatron.packed import _packed_class

        return _packed_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
