"""Keep the memory that CPU tensors free inside the process, for the next step to reuse.

glibc's malloc gives a large block (above a threshold that adapts up to 32 MiB) a mapping of
its own, unmapped on ``free``, and hands the top of its heap back once 128 KiB of it is free:
on a CPU every training step faults in and zeroes every 4 KiB page of its activations and
gradients again, in the kernel. :func:`keep_freed_memory` turns both off (``M_MMAP_MAX`` 0,
``M_TRIM_THRESHOLD`` 2 GiB, the most ``mallopt`` takes): resident memory stays at its peak,
like a caching allocator's; blocks mapped before the call keep their mappings until freed.
llama-20m ZeRO-2 on 2 emulated nodes x 2 ranks of a 2-core machine: 6% more tokens/s, 12%
less system time, 8% more peak memory (KVM Xeon, chrt -f 10; benchmarks/results/finetune_*.md).

:func:`release_freed_memory` restores glibc's default limits and hands the free heap back (the
threshold glibc would have adapted stays fixed). Elsewhere than glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import threading

from .._common.patch import change, forget

__all__ = ["keep_freed_memory", "release_freed_memory", "is_keeping_freed_memory"]

log = logging.getLogger("slipstream")

# <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_KEEP = {_M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: 2**31 - 1}
_GLIBC_DEFAULTS = {_M_MMAP_MAX: 65536, _M_TRIM_THRESHOLD: 128 * 1024}

_lock = threading.Lock()
_keeping = False


def _libc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def _set(libc, values: dict) -> None:
    for param, value in values.items():
        if not libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)):
            raise OSError(f"mallopt({param}, {value}) failed")


def keep_freed_memory() -> bool:
    """Keep freed blocks in the heap from now on; True if in effect (glibc only)."""
    global _keeping
    with _lock:
        if _keeping:
            return True
        libc = _libc()
        if libc is None:
            log.debug("slipstream: not glibc's malloc; freed CPU memory is handled as before")
            return False
        _set(libc, _KEEP)
        _keeping = True
    change("keep_freed_memory", "glibc malloc: freed memory kept in the process (mallopt)", release_freed_memory,
           owner="memory")
    return True


def release_freed_memory() -> None:
    """Undo :func:`keep_freed_memory`: glibc's default limits, the free heap trimmed."""
    global _keeping
    with _lock:
        if not _keeping:
            return
        libc = _libc()
        _set(libc, _GLIBC_DEFAULTS)
        libc.malloc_trim(ctypes.c_size_t(0))
        _keeping = False
    forget("keep_freed_memory")


def is_keeping_freed_memory() -> bool:
    return _keeping
