"""DeepSpeed adapter: ZeRO-1/2/3 collectives through the core, the varlen pass on the model,
enabled by a top-level ``"slipstream"`` section of the DeepSpeed config.

    engine, optimizer, loader, scheduler = slipstream.deepspeed.initialize(model=..., config=...)

or ``slipstream.enable()`` before a plain ``deepspeed.initialize``. ``translate`` imports no
DeepSpeed; the rest is loaded on first use and, without DeepSpeed, names the extra to install.
"""

from ..._common import lazy

_WHERE = {**dict.fromkeys(["CommBackend", "install_comm", "installed_backend", "uninstall_comm"], ".comm_backend"),
          **dict.fromkeys(["initialize", "install", "load_ds_config", "uninstall"], ".engine")}
__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy.attributes(__name__, _WHERE, requires=("deepspeed", "deepspeed"))
