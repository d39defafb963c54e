"""enable()'s stack hooks: installed when the stack is imported, without importing it first."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

SCRIPT = r"""
import sys
from slipstream.plugins import autoload
autoload.install_hooks()
autoload.install_hooks()  # idempotent
assert "deepspeed" not in sys.modules, "installing the hook must not import DeepSpeed"
import deepspeed
hooked = deepspeed.initialize
assert getattr(hooked, "__slipstream_patch__", None) == "deepspeed", "deepspeed.initialize was not hooked on import"
original = hooked.__wrapped__
assert not any(type(f).__name__ == "_AfterImport" and f.name == "deepspeed" for f in sys.meta_path), "finder left behind"
autoload.remove_hooks()
assert deepspeed.initialize is original
autoload.install_hooks()  # DeepSpeed already imported: hooked at once
assert deepspeed.initialize is not original and deepspeed.initialize.__wrapped__ is original
autoload.remove_hooks()
assert deepspeed.initialize is original
print("ok")
"""


def _run_ok(script: str) -> None:
    """Run ``script`` in a fresh interpreter (DeepSpeed not yet imported); it must print ok."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_deepspeed_is_hooked_on_import_and_restored_exactly():
    _run_ok(SCRIPT)


ENABLE_SCRIPT = r"""
import sys, slipstream
slipstream.enable()
import deepspeed
assert getattr(deepspeed.initialize, "__slipstream_patch__", None) == "deepspeed", "enable() did not switch DeepSpeed"
original = deepspeed.initialize.__wrapped__
slipstream.disable()
assert deepspeed.initialize is original
print("ok")
"""


def test_enable_switches_deepspeed_and_disable_restores_it():
    _run_ok(ENABLE_SCRIPT)


@pytest.mark.parametrize("value", [None, "", "  ", "0", "off", "1", "yes", "maybe"])
def test_status_reads_slipstream_autoload_as_the_start_up_hook_does(monkeypatch, value):
    """``slipstream.status()`` says the hook is off exactly when the hook's own parser says so."""
    import slipstream
    import slipstream_autoload

    if value is None:
        monkeypatch.delenv("SLIPSTREAM_AUTOLOAD", raising=False)
    else:
        monkeypatch.setenv("SLIPSTREAM_AUTOLOAD", value)
    hook_on = slipstream_autoload._flag("SLIPSTREAM_AUTOLOAD", True)
    assert (slipstream.status()["autoload"] == "off (SLIPSTREAM_AUTOLOAD=0)") is (not hook_on)


def test_the_start_up_line_runs_the_hook_and_is_silent_once_the_hook_is_gone(tmp_path):
    """The .pth line that setup.py installs, read by ``site`` in an interpreter that sees no
    installed slipstream (-I -S): with the hook module on the path it imports it; without it
    (an editable install whose checkout was deleted), it prints nothing."""
    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    line = ast.literal_eval(re.search(r"^LINE = (.+)$", setup, re.M).group(1))
    site_dir, hook_dir = tmp_path / "site", tmp_path / "hook"
    site_dir.mkdir()
    hook_dir.mkdir()
    (site_dir / "slipstream-autoload.pth").write_text(line)
    (hook_dir / "slipstream_autoload.py").write_text("print('hook ran')\n")
    code = f"import site, sys; sys.path[:0] = sys.argv[1:]; site.addsitedir({str(site_dir)!r})"
    for path, expected in (([str(hook_dir)], "hook ran\n"), ([], "")):
        proc = subprocess.run([sys.executable, "-I", "-S", "-c", code, *path], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, expected, ""), proc
