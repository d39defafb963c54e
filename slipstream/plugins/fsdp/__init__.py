"""Adapter for fsdp (not implemented yet: see the open issues)."""
