"""Slipstream: faster PyTorch training for DeepSpeed, FSDP and Megatron-core users.

``slipstream.core_comm`` holds the fast collectives, ``slipstream.core_compile`` the
padding-removal pass, ``slipstream.plugins`` the thin adapters for each training stack.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
