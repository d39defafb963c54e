"""Adapter for megatron (not implemented yet: see the open issues)."""
