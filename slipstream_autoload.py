"""Slipstream's start-up hook, run by ``slipstream-autoload.pth`` in every interpreter of the
environment it is installed in. It imports nothing but ``os``, ``sys`` and its finder
(``slipstream_after_import``) and does one thing:
when a job asks for slipstream, it puts a finder on ``sys.meta_path`` that acts once a stack
has been imported.

    SLIPSTREAM_AUTOLOAD=0   the hook does nothing at all
    SLIPSTREAM=1            once torch is imported: ``slipstream.enable()`` (the slipstream
                            backend becomes torch's default for CPU groups, and every stack
                            adapter installs when its stack is imported); so does
                            SLIPSTREAM_CONFIG=path (a file of slipstream's settings)
    (neither)               once DeepSpeed is imported: its adapter, so that a DeepSpeed
                            config with a ``"slipstream"`` section turns slipstream on, and
                            one without leaves DeepSpeed stock, but for torch's extension
                            build lock: a stale one cannot hang the job
                            (``slipstream/plugins/deepspeed/build_lock.py``)

Nothing else is imported until then, and a job that imports neither pays one ``find_spec``
call per import for a finder that answers None (measured in tests/test_autoload.py).
Errors in the hook never stop the interpreter: they are reported once on stderr.
"""

import os
import sys

from slipstream_after_import import AfterImport


class SlipstreamAutoload(AfterImport):
    """The start-up hook's finder: acts once ``torch`` (``SLIPSTREAM=1``) or ``deepspeed``
    (otherwise) has been imported."""

    def __init__(self, enable_all: bool) -> None:
        super().__init__({"torch"} if enable_all else {"deepspeed"}, self.act)
        self.enable_all = enable_all

    def act(self, name: str) -> None:
        try:
            if name == "torch":
                import slipstream

                slipstream.enable(source="SLIPSTREAM=1" if _flag("SLIPSTREAM") else "SLIPSTREAM_CONFIG")
            else:
                import importlib

                importlib.import_module("slipstream.plugins.deepspeed").install()
        except Exception as e:  # noqa: BLE001 - never take the user's interpreter down
            print(f"slipstream: the start-up hook could not act on {name}: {type(e).__name__}: {e} "
                  "(SLIPSTREAM_AUTOLOAD=0 turns the hook off)", file=sys.stderr)


def _flag(name: str, default: bool = False) -> bool:
    """A boolean variable (1/true/yes/on), parsed here without importing slipstream (which
    imports torch): the hook runs in every interpreter of the environment."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    return default


def install() -> None:
    """What the ``.pth`` line runs. Idempotent."""
    if not _flag("SLIPSTREAM_AUTOLOAD", True):
        return
    if any(type(f).__name__ == "SlipstreamAutoload" for f in sys.meta_path):
        return
    finder = SlipstreamAutoload(_flag("SLIPSTREAM") or bool(os.environ.get("SLIPSTREAM_CONFIG")))
    for name in tuple(finder.pending):
        if name in sys.modules:  # already imported (the hook run late, by hand)
            finder.done(name)
    if finder.pending:
        sys.meta_path.insert(0, finder)


try:
    install()
except Exception as _e:  # noqa: BLE001
    print(f"slipstream: start-up hook failed: {_e} (SLIPSTREAM_AUTOLOAD=0 turns it off)", file=sys.stderr)
