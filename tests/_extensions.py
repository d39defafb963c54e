"""A torch extensions directory of a test's own (``TORCH_EXTENSIONS_DIR``), so that the stale
locks a test makes and the ranks it kills never touch the machine's shared one, which other
people's DeepSpeed jobs use at the same time."""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

OP = "deepspeed_shm_comm"  # the op every DeepSpeed job on a CPU builds or loads


def built_op() -> Path | None:
    """The machine's build directory of DeepSpeed's shm op, if the op is built there."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    found = sorted(glob.glob(os.path.join(root, OP, f"{OP}.so")) + glob.glob(os.path.join(root, "*", OP, f"{OP}.so")))
    return Path(found[0]).parent if found else None


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
