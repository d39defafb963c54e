"""Subcommands of the ``slipstream`` CLI that are neither benchmarks nor recipes."""
