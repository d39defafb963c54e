"""Every setting of slipstream, in one place: the section a stack's config carries
(``SlipstreamConfig``) and its parts (``CommConfig``, ``VarlenConfig``, ``CompileConfig``).

First found first: code (``pg_options``, ``slipstream.enable(config)``) > the stack's section
(or the file ``SLIPSTREAM_CONFIG`` names) > ``SLIPSTREAM_*`` variables > the defaults. A bad
value is refused naming its key, file or variable.
"""

from ._common.settings import CONFIG_VAR
from .core_comm.config import CommConfig
from .core_compile.autotune.config import CompileConfig
from .core_compile.varlen.config import VarlenConfig
from .plugins.config import SlipstreamConfig

__all__ = ["CONFIG_VAR", "CommConfig", "CompileConfig", "SlipstreamConfig", "VarlenConfig"]
