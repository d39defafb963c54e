"""FSDP adapter: FSDP2's collectives through the core (``fsdp2.apply``, i.e.
``slipstream.fsdp.apply``, through torch's ``set_custom_all_gather`` /
``set_custom_reduce_scatter``), FSDP1's gradient reduce-scatter as a comm hook (``fsdp1``);
``translate`` holds slipstream's settings in FSDP's terms (no FSDP import)."""
