"""``slipstream.megatron``: Megatron-LM's ``--slipstream`` flags and Megatron-core's groups on
the core (see ``slipstream.plugins.megatron``)."""

from .plugins.megatron import add_arguments, chain, initialize, process_groups, restore_process_groups

__all__ = ["add_arguments", "chain", "initialize", "process_groups", "restore_process_groups"]
