"""Every setting of slipstream, in one place: the section a stack's config carries
(``SlipstreamConfig``) and its parts (``CommConfig``, ``VarlenConfig``, ``CompileConfig``).

Settings, first found first: code (a ``CommConfig`` given as ``pg_options`` or to
``slipstream.enable(config)``) > the stack's section (the DeepSpeed JSON's ``"slipstream"``, or
the file ``SLIPSTREAM_CONFIG`` names) > ``SLIPSTREAM_*`` variables > the defaults. Each class
reads a dict with ``from_dict`` and writes one with ``to_dict``; a bad value is refused naming
its key, file or variable.
"""

from ._common.settings import CONFIG_VAR
from .core_comm.config import CommConfig
from .core_compile.autotune.config import CompileConfig
from .core_compile.varlen.hf_model import VarlenConfig
from .plugins.config import SlipstreamConfig

__all__ = ["CONFIG_VAR", "CommConfig", "CompileConfig", "SlipstreamConfig", "VarlenConfig"]
