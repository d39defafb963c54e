"""``slipstream.megatron``: Megatron-LM's ``--slipstream`` flags, Megatron-core's groups on
the core, the compile hook, and packed (THD) sequences for the local attention (see
``slipstream.plugins.megatron``)."""

from __future__ import annotations

import argparse

from ._common import lazy
from .plugins.megatron import (add_arguments, chain, disable_compile, disable_packed_attention, enable_compile,
                               enable_packed_attention, local_spec, name_backend, pack_batch, packed_attention,
                               process_groups, read_arguments, restore_process_groups)
from .switch import enable

__all__ = ["PackedDotProductAttention", "add_arguments", "chain", "disable_compile", "disable_packed_attention",
           "enable_compile", "enable_packed_attention", "initialize", "local_spec", "pack_batch", "packed_attention",
           "process_groups", "restore_process_groups"]


def initialize(args: argparse.Namespace) -> bool:
    """Act on the parsed flags of ``add_arguments`` before Megatron initialises
    torch.distributed. Returns whether slipstream's collectives are on: with ``--slipstream``,
    slipstream is enabled (with ``--slipstream-config``'s ``"comm"`` settings) and the backend
    Megatron-LM names becomes ``slipstream`` for CPU tensors (CUDA keeps NCCL)."""
    on, settings = read_arguments(args)
    if not on:
        return False
    enable(settings.comm if settings is not None else None, source="--slipstream")
    name_backend(args)
    return True


__getattr__, __dir__ = lazy.attributes(__name__, {"PackedDotProductAttention": ".plugins.megatron"})
