import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _netns_reason() -> str | None:
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "the emulated cluster needs iproute2 (ip, tc)"
    return None


def pytest_collection_modifyitems(config, items):
    if not config.option.markexpr:  # a tier's further cases run when it is asked for by name
        matrix = [item for item in items if "matrix" in item.keywords]
        if matrix:
            config.hook.pytest_deselected(items=matrix)
            items[:] = [item for item in items if "matrix" not in item.keywords]
    gpu = _has_gpu()
    netns_reason = _netns_reason()
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; none on this machine"))
        if "netns" in item.keywords and netns_reason:
            item.add_marker(pytest.mark.skip(reason=netns_reason))
