"""``slipstream.data``: batches prepared ahead of the step (``AsyncLoader``, in
``slipstream.core_compile.loader``)."""

from .core_compile.loader import AsyncLoader

__all__ = ["AsyncLoader"]
