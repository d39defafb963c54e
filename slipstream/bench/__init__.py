"""Benchmarks that measure slipstream and the stock path side by side in one run."""
