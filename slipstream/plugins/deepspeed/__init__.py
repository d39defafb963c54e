"""DeepSpeed adapter: ZeRO-1/2/3 collectives through the core, the varlen pass on the model,
enabled by a top-level ``"slipstream"`` section of the DeepSpeed config.

    engine, optimizer, loader, scheduler = slipstream.deepspeed.initialize(model=..., config=...)

or ``slipstream.enable()`` before a plain ``deepspeed.initialize``. Needs the ``deepspeed``
extra: ``pip install "slipstream[deepspeed]"``.
"""

try:
    import deepspeed as _deepspeed  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError('the DeepSpeed adapter needs DeepSpeed: pip install "slipstream[deepspeed]"') from e

from .comm import CommBackend, install_comm, installed_backend, uninstall_comm
from .engine import initialize, install, load_ds_config, uninstall

__all__ = [
    "CommBackend",
    "initialize",
    "install",
    "install_comm",
    "installed_backend",
    "load_ds_config",
    "uninstall",
    "uninstall_comm",
]
