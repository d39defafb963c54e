"""A non-editable install works from any directory: wheel built, installed into a fresh venv,
``slipstream finetune`` run from an empty directory with that venv's copy of the package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from _extensions import machine_root  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Build outputs and caches of the checkout: a stale build/lib would end up in the wheel.
_BUILT = shutil.ignore_patterns(".git", "build", "dist", "out", "*.egg-info", "__pycache__", ".pytest_cache")


def _not_sources(folder: str, names: list[str]) -> set[str]:
    """What not to copy of ``folder``: build outputs and caches, and virtual environments (a
    ``.venv`` made inside the checkout, as many users make it, holds torch: gigabytes)."""
    venvs = {n for n in names if os.path.isfile(os.path.join(folder, n, "pyvenv.cfg"))}
    return set(_BUILT(folder, names)) | venvs


def _run(argv: list, *, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (
        f"{argv} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return proc


def _builds_wheels() -> bool:
    """Whether this interpreter's setuptools makes wheels: with ``bdist_wheel`` of its own
    (70.1 and later) or of the ``wheel`` package. A venv that Python 3.11 made has neither
    (setuptools 65.5 from ensurepip)."""
    from importlib import metadata, util

    try:
        version = metadata.version("setuptools")
    except metadata.PackageNotFoundError:
        return False
    major, minor = (int(p) if p.isdigit() else 0 for p in (version.split(".") + ["0"])[:2])
    return (major, minor) >= (70, 1) or util.find_spec("wheel") is not None


def _see_this_interpreters_packages(venv: Path) -> None:
    """Give ``venv`` this interpreter's site directories after its own, through a ``.pth``.

    torch, deepspeed, pip and transformers come from there, and the checkout's editable install
    too: the venv's own site-packages come first on sys.path, ahead of the editable finder
    (appended to sys.meta_path), so the venv's copy of slipstream wins. Not
    ``--system-site-packages``: from an interpreter that is itself a venv (pytest run in the
    README's venv) that gives the base interpreter's packages, which have no torch."""
    import site

    ours = {*site.getsitepackages(), site.getusersitepackages()}
    dirs = [p for p in sys.path if p in ours]  # in this interpreter's order
    (own,) = venv.glob("lib/python*/site-packages")
    (own / "this-interpreters-site-packages.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")


@pytest.mark.slow
def test_wheel_in_fresh_venv_finetunes_from_an_empty_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    # A home of its own: the tokenizer is trained into an empty cache (~3 s), not read from the
    # user's. DeepSpeed's compiled shm op stays where this environment's jobs build it: built
    # afresh into the new home (or beside the machine's) it took 85 s of the run's 125 s on 2 cores.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(machine_root()))
    home = tmp_path / "home"
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), PIP_NO_INDEX="1")
    src, wheels, venv, workdir = (tmp_path / d for d in ("src", "wheels", "venv", "empty"))
    shutil.copytree(REPO, src, ignore=_not_sources)
    workdir.mkdir()

    if _builds_wheels():  # offline, with this interpreter's setuptools
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, src],
             cwd=tmp_path, env=env, timeout=300)
    else:  # in pip's build isolation, with the setuptools pyproject.toml asks for from the index
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", wheels, src], cwd=tmp_path,
             env={k: v for k, v in env.items() if k != "PIP_NO_INDEX"}, timeout=300)
    (wheel,) = wheels.glob("slipstream-*.whl")
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path, env=env, timeout=120)
    _see_this_interpreters_packages(venv)
    python = venv / "bin" / "python"
    # --ignore-installed: pip would otherwise try to uninstall the editable install first (it
    # refuses, being outside the venv, but it should not even try).
    _run([python, "-m", "pip", "install", "--no-deps", "--ignore-installed", wheel], cwd=tmp_path,
         env=env, timeout=300)

    where = _run([python, "-c", "import slipstream; print(slipstream.__file__)"], cwd=workdir, env=env,
                 timeout=120).stdout.strip()
    assert Path(where).resolve().is_relative_to(venv.resolve()), where
    # the start-up hook came with the wheel, and runs without importing torch
    hook = _run([python, "-c", "import sys; m = sys.modules.get('slipstream_autoload'); "
                 "print(m.__file__ if m else None, 'torch' in sys.modules)"], cwd=workdir, env=env, timeout=60)
    hook_file, torch_loaded = hook.stdout.split()
    assert Path(hook_file).resolve().is_relative_to(venv.resolve()) and torch_loaded == "False", hook.stdout

    out = workdir / "run"
    _run([venv / "bin" / "slipstream", "finetune", "--steps", "2", "--samples", "32", "--max-length",
          "128", "--batch-size", "4", "--output-dir", out, "--timeout", "300"],
         cwd=workdir, env=env, timeout=400)
    assert (out / "slipstream.json").is_file() and (out / "checkpoint-slipstream").is_dir()
    assert sorted(p.name for p in workdir.iterdir()) == ["run"]
