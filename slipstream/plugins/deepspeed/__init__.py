"""DeepSpeed adapter: ZeRO-1/2/3 collectives through the core, the varlen pass on the model,
enabled by a top-level ``"slipstream"`` section of the DeepSpeed config.

    engine, optimizer, loader, scheduler = slipstream.deepspeed.initialize(model=..., config=...)

or ``slipstream.enable()`` before a plain ``deepspeed.initialize``. Needs the ``deepspeed``
extra: ``pip install "slipstream[deepspeed]"``. ``translate`` (DeepSpeed's terms for
slipstream's settings) imports no DeepSpeed; the rest is loaded on first use and says which
extra to install when DeepSpeed is missing.
"""

import importlib

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

_WHERE = {"CommBackend": "comm_backend", "install_comm": "comm_backend", "installed_backend": "comm_backend",
          "uninstall_comm": "comm_backend",
          "initialize": "engine", "install": "engine", "load_ds_config": "engine", "uninstall": "engine"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError('the DeepSpeed adapter needs DeepSpeed: pip install "slipstream[deepspeed]"') from e
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
