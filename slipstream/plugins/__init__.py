"""Thin adapters: the only place that imports a training stack (DeepSpeed, accelerate, Megatron,
the Hugging Face Trainer)."""
