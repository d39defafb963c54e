"""Install each stack's adapter hook when that stack is imported, never importing it first.

``slipstream.enable()`` calls ``install_hooks()``: a stack already imported gets its hook at
once; for one imported later, a finder on ``sys.meta_path`` (the start-up hook's,
``slipstream_after_import.AfterImport``) runs the hook right after the stack's module has
executed, then removes itself. ``remove_hooks()`` undoes both exactly.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys

from slipstream_after_import import AfterImport

from .._common import lazy

__all__ = ["install_hooks", "remove_hooks"]

# stack module -> adapter module with install() / uninstall()
ADAPTERS = {"deepspeed": "slipstream.plugins.deepspeed", "accelerate": "slipstream.plugins.accelerate",
            "megatron.core": "slipstream.plugins.megatron", "transformers": "slipstream.plugins.transformers"}


class _AdapterHook(AfterImport):
    """Installs the adapter of one stack once the stack has been imported."""

    def __init__(self, name: str) -> None:
        super().__init__({name}, lambda stack: importlib.import_module(ADAPTERS[stack]).install())
        self.name = name


class _WhenInitialised(importlib.abc.MetaPathFinder):
    """For a stack that is being imported when ``install_hooks`` runs (``enable()`` reached
    from inside its own import, e.g. torch imported by accelerate's first lines): installs the
    adapter at the first import after the stack's has finished, then removes itself. Finds
    nothing itself."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        module = sys.modules.get(self.name)
        if module is None or _initialising(module):
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        importlib.import_module(ADAPTERS[self.name]).install()
        return None


def _initialising(module) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def install_hooks() -> None:
    """Idempotent."""
    for name, adapter in ADAPTERS.items():
        module = sys.modules.get(name)  # None: imported and absent, or blocked (``sys.modules[name] = None``)
        if module is not None and _initialising(module):
            if not any(isinstance(f, _WhenInitialised) and f.name == name for f in sys.meta_path):
                sys.meta_path.insert(0, _WhenInitialised(name))
        elif module is not None:
            importlib.import_module(adapter).install()
        elif lazy.installed(name) and not any(
            isinstance(f, _AdapterHook) and f.name == name for f in sys.meta_path
        ):
            sys.meta_path.insert(0, _AdapterHook(name))


def remove_hooks() -> None:
    """Undo ``install_hooks``: pending finders go, installed adapters uninstall."""
    for name, adapter in ADAPTERS.items():
        sys.meta_path[:] = [f for f in sys.meta_path
                            if not (isinstance(f, (_AdapterHook, _WhenInitialised)) and f.name == name)]
        if sys.modules.get(name) is not None:
            importlib.import_module(adapter).uninstall()
