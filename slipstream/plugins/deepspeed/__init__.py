"""DeepSpeed adapter: ZeRO-1/2/3 collectives through the core, the varlen pass on the model,
enabled by a top-level ``"slipstream"`` section of the DeepSpeed config.

    engine, optimizer, loader, scheduler = slipstream.deepspeed.initialize(model=..., config=...)

or ``slipstream.enable()`` before a plain ``deepspeed.initialize``. ``translate`` imports no
DeepSpeed; the rest is loaded on first use and, without DeepSpeed, names the extra to install.
"""

import importlib

_WHERE = {**dict.fromkeys(["CommBackend", "install_comm", "installed_backend", "uninstall_comm"], "comm_backend"),
          **dict.fromkeys(["initialize", "install", "load_ds_config", "uninstall"], "engine")}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError('the DeepSpeed adapter needs DeepSpeed: pip install "slipstream[deepspeed]"') from e
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
