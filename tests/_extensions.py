"""A torch extensions directory of a test's own (``TORCH_EXTENSIONS_DIR``), so that the stale
locks a test makes and the ranks it kills never touch the machine's shared one, which other
people's DeepSpeed jobs use at the same time."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

OP = "deepspeed_shm_comm"  # the op every DeepSpeed job on a CPU builds or loads
# What a DeepSpeed job on a CPU does at start-up (deepspeed.comm's build_shm_op)
_LOAD = "from deepspeed.accelerator import get_accelerator as g; g().create_op_builder('ShareMemCommBuilder').load()"


@functools.cache
def _current() -> bool:
    """Build the op in the machine's extensions root, or bring it up to date there, as this
    environment's first DeepSpeed job would, once a run: a copy of an op built against another
    install of DeepSpeed (an older copy of its sources) is rebuilt by every job given it, past
    the bounds of the jobs the tests time (~90 s on 2 cores, more with a test beside it)."""
    try:
        proc = subprocess.run([sys.executable, "-c", _LOAD], capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def machine_root() -> Path:
    """Where this environment's DeepSpeed jobs build their ops: ``$TORCH_EXTENSIONS_DIR``, else
    torch's default root and its folder for this Python and torch build (as
    ``torch.utils.cpp_extension`` names it). A job given the default root itself as
    ``TORCH_EXTENSIONS_DIR`` builds in another folder, beside that one."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    build = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{build}"


def built_op() -> Path | None:
    """The build directory of DeepSpeed's shm op where this environment's jobs load it, built
    for this environment's DeepSpeed (None where it cannot be built here)."""
    op = machine_root() / OP
    return op if _current() and (op / f"{OP}.so").is_file() else None


def extensions_dir(path: Path, *, built: bool) -> Path:
    """``path`` made an extensions root; with a copy of the built op (never its lock) when
    ``built`` and the machine has one, so the job loads it instead of building it (~90 s)."""
    path.mkdir(parents=True, exist_ok=True)
    source = built_op() if built else None
    if source is not None:
        shutil.copytree(source, path / OP, ignore=shutil.ignore_patterns("lock"))
    return path


def locks(root: Path) -> list[Path]:
    return sorted(root.glob("*/lock"))
