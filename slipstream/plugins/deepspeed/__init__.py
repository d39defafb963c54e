"""Adapter for deepspeed (not implemented yet: see the open issues)."""
