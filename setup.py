"""Installs ``slipstream-autoload.pth`` beside the package, in wheels and editable installs
alike: one line that imports ``slipstream_autoload`` (see that module: it imports no torch and
does nothing unless a job asks for slipstream; ``SLIPSTREAM_AUTOLOAD=0`` turns it off). Where
the module is gone but the line stays (an editable install whose checkout was then deleted),
the line does nothing: a plain import would print a traceback at every start of Python.
Everything else about the package is in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "slipstream-autoload.pth"
LINE = 'import importlib.util as u; u.find_spec("slipstream_autoload") and __import__("slipstream_autoload")\n'


class BuildPyWithHook(build_py):
    """A wheel (``pip install .``): the .pth at the root of the installed files."""

    def run(self):
        super().run()
        if not self.editable_mode:
            Path(self.build_lib, PTH).write_text(LINE)

    def get_outputs(self, include_bytecode=True):
        extra = [] if self.editable_mode else [str(Path(self.build_lib, PTH))]
        return [*super().get_outputs(include_bytecode), *extra]


class EditableWithHook(editable_wheel):
    """An editable install (``pip install -e .``): the .pth beside setuptools' own."""

    def _install_namespaces(self, installation_dir, pth_prefix):
        super()._install_namespaces(installation_dir, pth_prefix)
        Path(installation_dir, PTH).write_text(LINE)


setup(cmdclass={"build_py": BuildPyWithHook, "editable_wheel": EditableWithHook})
