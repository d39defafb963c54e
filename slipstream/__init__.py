"""Slipstream: faster PyTorch training for DeepSpeed, FSDP and Megatron-core users.

Importing slipstream registers the ``slipstream`` torch.distributed backend
(``dist.init_process_group("slipstream")``) and changes no default; it imports
torch.distributed, never an optional framework, and loads the communicator, the compute passes
and the tools only when they are first used. ``slipstream.enable()`` makes the backend the
default for CPU, ``slipstream.disable()`` undoes that exactly, ``slipstream.status()`` says
what slipstream does in this process.
"""

from ._common import lazy, record
from ._common.version import __version__
from .core_comm.backend.registry import register as _register
from .switch import disable, enable, is_enabled

__all__ = ["CompileConfig", "DDPHookState", "__version__", "compile", "compile_report", "ddp_hook", "disable",
           "enable", "is_enabled", "status", "uncompile"]

# What enable, status and the backend's registration need loads now; the rest on first use.
__getattr__, __dir__ = lazy.attributes(__name__, {
    "status": "._status", **dict.fromkeys(["DDPHookState", "ddp_hook"], ".core_comm.backend.ddp_hook"),
    **dict.fromkeys(["compile", "compile_report", "uncompile"], ".core_compile.autotune.api"),
    "CompileConfig": ".core_compile.autotune.config"})


def _announce() -> None:
    from ._status import announce

    announce()


record.on_start(_announce)  # the start line, when a job first uses slipstream
_register()
