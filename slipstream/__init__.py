"""Slipstream: faster PyTorch training for DeepSpeed, FSDP and Megatron-core users.

Importing slipstream registers the ``slipstream`` torch.distributed backend
(``dist.init_process_group("slipstream")``) and changes no default; it imports
torch.distributed, never an optional framework. ``slipstream.enable()`` makes the backend the
default for CPU, ``slipstream.disable()`` undoes that exactly, ``slipstream.status()`` says
what slipstream does in this process.
"""

from ._common.version import __version__
from ._status import status
from .core_comm.backend.ddp_hook import DDPHookState, ddp_hook
from .core_comm.backend.registry import register as _register
from .core_compile.autotune.api import compile, compile_report, uncompile
from .core_compile.autotune.config import CompileConfig
from .switch import disable, enable, is_enabled

__all__ = ["CompileConfig", "DDPHookState", "__version__", "compile", "compile_report", "ddp_hook", "disable",
           "enable", "is_enabled", "status", "uncompile"]

_register()
