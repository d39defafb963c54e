"""FSDP adapter: PyTorch FSDP2's collectives through the core.

``comms.apply(model)`` (``slipstream.fsdp.apply``) switches every ``fully_shard`` module's
parameter all-gather and gradient reduce-scatter to the core's communicator of its group,
through torch's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``; ``translate``
holds slipstream's settings in FSDP's terms (no FSDP import).
"""
