"""The one lazy loader: a package's public names loaded from their modules on first use (PEP 562).

    __getattr__, __dir__ = lazy.attributes(__name__, {"compile": ".core_compile.autotune.api", ...})

A target is ``"module"`` (its attribute of the same name; ``".name"`` for ``name`` itself is the
submodule), ``"module:attr"`` or a function of no arguments that builds the value (a subclass of
an optional framework's class). Relative module names resolve against the package.
``requires=(module, extra)`` names an optional framework: a missing one raises an ImportError
naming the extra to install. A loaded value is cached in the module, so each name costs one
import.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any, Callable, Mapping

__all__ = ["attributes", "installed"]


def attributes(module: str, table: Mapping[str, str | Callable[[], Any]], *,
               requires: tuple[str, str] | None = None):
    """``(__getattr__, __dir__)`` for ``module`` serving the names in ``table``."""

    def __getattr__(name: str):
        target = table.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if requires is not None:
            _require(*requires)
        if callable(target):
            value = target()
        else:
            path, _, attr = target.partition(":")
            found = importlib.import_module(path, _package(module))
            value = found if path == "." + name else getattr(found, attr or name)
        setattr(sys.modules[module], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module])) | set(table))

    return __getattr__, __dir__


def _package(module: str) -> str:
    mod = sys.modules[module]
    return module if hasattr(mod, "__path__") else module.rpartition(".")[0]


def _require(framework: str, extra: str) -> None:
    try:
        importlib.import_module(framework)
    except ImportError as e:
        raise ImportError(f'this part of slipstream needs {framework}: pip install "slipstream[{extra}]"') from e


def installed(name: str) -> bool:
    """Whether module ``name`` can be imported, without importing it. ``find_spec`` of a dotted
    name imports its parent and raises where the parent is missing (``megatron.core`` without
    megatron): that is ``False`` here."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
