"""``AfterImport``: a finder that runs a function right after a module has been imported, without
importing anything itself. It lives outside the package, beside the start-up hook
(``slipstream_autoload``), so that the hook uses it without importing slipstream (which imports
torch), and slipstream's stack adapters (``slipstream.plugins.autoload``) use it without importing
the hook."""

import sys

__all__ = ["AfterImport"]


class AfterImport:
    """A finder that runs ``then(name)`` right after module ``name`` (one of ``names``) has
    executed, by wrapping its loader; it leaves ``sys.meta_path`` once every name has been
    imported. It imports nothing itself."""

    def __init__(self, names, then) -> None:
        self.pending = set(names)
        self.then = then
        self._searching = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending or self._searching:
            return None
        import importlib.util

        self._searching = True
        try:
            spec = importlib.util.find_spec(fullname)  # the finders after this one
        finally:
            self._searching = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Then(spec.loader, self, fullname)
        return spec

    def done(self, name: str) -> None:
        self.pending.discard(name)
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        self.then(name)


class _Then:
    def __init__(self, loader, finder: AfterImport, name: str) -> None:
        self._loader, self._finder, self._name = loader, finder, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._finder.done(self._name)

    def __getattr__(self, name):  # the wrapped loader's other methods (get_code, is_package...)
        return getattr(self._loader, name)
