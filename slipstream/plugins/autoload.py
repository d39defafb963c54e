"""Install each stack's adapter hook when that stack is imported, never importing it first.

``slipstream.enable()`` calls ``install_hooks()``: a stack already imported gets its hook at
once; for one imported later, a finder on ``sys.meta_path`` runs the hook right after the
stack's module has executed, then removes itself. ``remove_hooks()`` undoes both exactly.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__all__ = ["install_hooks", "remove_hooks"]

# stack module -> adapter module with install() / uninstall()
ADAPTERS = {"deepspeed": "slipstream.plugins.deepspeed", "accelerate": "slipstream.plugins.accelerate",
            "megatron.core": "slipstream.plugins.megatron"}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``install()`` of the adapter once ``name`` has been imported."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._searching = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self._searching:
            return None
        self._searching = True
        try:
            spec = importlib.util.find_spec(fullname)  # the finders after this one
        finally:
            self._searching = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenInstall(spec.loader, self)
        return spec


class _ThenInstall(importlib.abc.Loader):
    def __init__(self, loader, finder: _AfterImport) -> None:
        self._loader, self._finder = loader, finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _remove_finder(self._finder.name)
        importlib.import_module(ADAPTERS[self._finder.name]).install()


def _remove_finder(name: str) -> None:
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not (isinstance(f, (_AfterImport, _WhenInitialised)) and f.name == name)]


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
        if name in sys.modules and _initialising(sys.modules[name]):
            if not any(isinstance(f, _WhenInitialised) and f.name == name for f in sys.meta_path):
                sys.meta_path.insert(0, _WhenInitialised(name))
        elif name in sys.modules:
            importlib.import_module(adapter).install()
        elif importlib.util.find_spec(name) is not None and not any(
            isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path
        ):
            sys.meta_path.insert(0, _AfterImport(name))


def remove_hooks() -> None:
    """Undo ``install_hooks``: pending finders go, installed adapters uninstall."""
    for name, adapter in ADAPTERS.items():
        _remove_finder(name)
        if name in sys.modules:
            importlib.import_module(adapter).uninstall()
