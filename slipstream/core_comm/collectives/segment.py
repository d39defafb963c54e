"""The segment a ``ShmComm`` group shares (layout in ``shm.py``'s docstring): the fields of a
rank's control line and the codes written into them, creating and mapping the segment, and
reading what peers wrote (a control line as text, whether a peer's process is gone).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets

import torch.distributed as dist

from ..ops import DTYPES, KINDS, OPS, name_of

KINDS_HERE = KINDS + tuple(f"cma_{k}" for k in KINDS)
"""The calls a control line names: the shared-memory ones, and those of ``cma.py``."""

_LINE = 64  # bytes of one control line; also the alignment of slots and slices
_STEP, _SEQ, _KIND, _NUMEL, _DTYPE, _OP, _PID, _ADDR = range(8)
_LINE_WORDS = _LINE // 8
_ABORTED = -1  # the seq of a rank that failed a call begun with ``start``


_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1  # x86-64 Linux, the only platform of shm.py
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(addr: int, value: int, timeout_s: float) -> None:
    """Sleep (the GIL released) until a ``futex_wake`` on ``addr``, ``timeout_s`` passes, or at
    once when the 32-bit word at ``addr`` (a step counter's low half, in the shared segment)
    no longer holds ``value``'s low half: the kernel compares, so no wake-up is lost."""
    ts = _Timespec(int(timeout_s), int(timeout_s % 1 * 1e9))
    low = (value + 2**31) % 2**32 - 2**31
    _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAIT), ctypes.c_int(low),
                  ctypes.byref(ts), None, ctypes.c_int(0))


def futex_wake(addr: int) -> None:
    """Wake every rank sleeping in ``futex_wait`` on ``addr`` (a syscall, ~1 us with none)."""
    _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE),
                  ctypes.c_int(2**31 - 1), None, None, ctypes.c_int(0))


class ShmError(RuntimeError):
    """A shared-memory collective could not complete (peer died, timed out, mismatched call)."""


def _process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _describe(fields) -> str:
    """Text for the (kind, numel, dtype, op) fields of a control line."""
    kind, numel, dtype, op = (int(v) for v in fields[:4])
    return f"{name_of(KINDS_HERE, kind)} of {numel} x {name_of(DTYPES, dtype)} ({name_of(OPS, op)})"


SHM_DIR = "/dev/shm"
_PREFIX = "slipstream-"


def segment_name(pid: int) -> str:
    """A new segment's name: our prefix, the creating process, 128 random bits."""
    return f"{_PREFIX}{pid}-{secrets.token_hex(16)}"


def creator(name: str) -> int | None:
    """The pid in a segment's name made by ``segment_name``; None for any other name."""
    parts = name[len(_PREFIX):].split("-")
    if not name.startswith(_PREFIX) or len(parts) != 2 or not parts[0].isdigit() or len(parts[1]) != 32:
        return None
    return int(parts[0])


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove the segments of dead slipstream processes (named by ``segment_name``, owned by
    this user, their creator gone; nothing else) and return their paths. A live segment's name
    exists only for the milliseconds of its set-up: one left behind means its creator died."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = creator(name)
        if pid is None:
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path, follow_symlinks=False).st_uid != os.getuid() or not _process_gone(pid):
                continue
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    return removed


def _map_segment(group, rank: int, nbytes: int) -> tuple[mmap.mmap, str]:
    """Create (rank 0) or open (others) the group's segment and unlink its name once all
    ranks have mapped it. Collective over ``group``. Rank 0 first removes stale segments of
    dead jobs (``sweep_stale``), and unlinks only the name it created."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    path = None
    created = False
    fd = -1
    try:
        error = None
        if rank == 0:
            sweep_stale()
            path = os.path.join(SHM_DIR, segment_name(os.getpid()))
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                created = True
                os.posix_fallocate(fd, 0, nbytes)  # fail now, not with SIGBUS mid-collective
            except OSError as e:
                error = f"cannot allocate {nbytes} bytes in /dev/shm: {e}"
        box = [path, error]  # every rank learns of a failure, so all fall back alike
        dist.broadcast_object_list(box, src=src, group=group)
        path, error = box
        if error:
            raise ShmError(error)
        if rank != 0:
            fd = os.open(path, os.O_RDWR)
        mm = mmap.mmap(fd, nbytes)
        dist.barrier(group=group)
        return mm, path
    except BaseException as e:
        if not created:  # the creator may have died holding the name: remove it if so
            sweep_stale()
        if isinstance(e, RuntimeError) and not isinstance(e, ShmError):
            # gloo's: a peer is lost, so no fallback either (ShmError would fall back); say whose
            ranks = dist.get_process_group_ranks(group) if group is not None else "all"
            raise RuntimeError(f"slipstream: the shared-memory set-up of global ranks {ranks} failed: one "
                               f"of them died or did not arrive ({e})") from e
        raise
    finally:
        if fd >= 0:
            os.close(fd)
        if created:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
