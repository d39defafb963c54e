"""Slipstream: faster PyTorch training for DeepSpeed, FSDP and Megatron-core users.

``slipstream.core_comm`` holds the fast collectives, ``slipstream.core_compile`` the
padding-removal pass and the compile autotuner (``slipstream.compile``), ``slipstream.plugins``
the thin adapters for each training stack.

Importing slipstream registers the ``slipstream`` torch.distributed backend, so that
``dist.init_process_group("slipstream")`` works; it changes no default. ``slipstream.enable()``
makes it the default for CPU, ``slipstream.disable()`` undoes that exactly, and
``slipstream.status()`` says what slipstream is doing in this process. Importing
slipstream imports torch.distributed, never an optional framework.
"""

from ._common.version import __version__
from ._status import status
from .core_comm.backend.ddp_hook import DDPHookState, ddp_hook
from .core_comm.backend.registry import register as _register
from .core_compile.autotune.autotuner import compile, compile_report, uncompile
from .core_compile.autotune.config import CompileConfig
from .switch import disable, enable, is_enabled
__all__ = [
    "CompileConfig", "DDPHookState", "__version__", "compile", "compile_report", "ddp_hook", "disable", "enable",
    "is_enabled", "status", "uncompile",
]

_register()
