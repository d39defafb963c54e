"""Padding removal for variable-length batches: same loss and gradients as the padded run."""
