import atexit
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# "overlap": "auto" keeps its choices per model and layout: the suite's jobs keep theirs in a
# folder of their own (removed at the end), so that no run of the suite takes another's
_OVERLAP_DIR = tempfile.mkdtemp(prefix="slipstream-test-overlap-")
os.environ.setdefault("SLIPSTREAM_OVERLAP_DIR", _OVERLAP_DIR)
atexit.register(shutil.rmtree, _OVERLAP_DIR, True)


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


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the xdist_group added here
def pytest_collection_modifyitems(config, items):
    # a tier's further cases run when it is asked for by name (-m faults, -m netfaults, -m matrix),
    # not under another selection (-m "not slow")
    if not re.search(r"\b(matrix|faults|netfaults)\b", config.option.markexpr or ""):
        matrix = [item for item in items if "matrix" in item.keywords]
        if matrix:
            config.hook.pytest_deselected(items=matrix)
            items[:] = [item for item in items if "matrix" not in item.keywords]
    gpu = _has_gpu()
    netns_reason = _netns_reason()
    for item in items:
        if item.path.name in TIMED_MODULES:
            item.add_marker(pytest.mark.timed)
        if _timed(item):
            item.add_marker(pytest.mark.xdist_group("timed"))
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; none on this machine"))
        if "netns" in item.keywords and netns_reason:
            item.add_marker(pytest.mark.skip(reason=netns_reason))


# Modules whose every test times something or waits on a clock (a compile's share of the time,
# exits within a timeout): under -n they run alone. Other such tests are marked timed.
TIMED_MODULES = {"test_compile_bounded.py", "test_faults.py", "test_netfaults.py", "test_segments.py"}
ALONE_WAIT_S = 1800  # the longest a test waits for its turn: the timed tests all run before it, at most


class _Alone:
    """Under pytest-xdist (``-n 2``) a test marked ``timed`` runs with no other test beside it;
    the rest run two at a time. The timed tests form one xdist group (one worker runs them in
    turn: ``--dist loadgroup``, which the conftest sets under ``-n``) and hold a lock the workers
    share exclusively from the first to the last; any other test takes it shared, after a
    turnstile that a waiting timed test holds, so that no new test starts beside it."""

    def __init__(self, folder: str):
        self.gate = open(os.path.join(folder, "turnstile"), "a")
        self.lock = open(os.path.join(folder, "lock"), "a")
        self.held: int | None = None

    def before(self, item) -> None:
        want = fcntl.LOCK_EX if _timed(item) else fcntl.LOCK_SH
        if self.held == want:
            return
        self.release()
        _take(self.gate, fcntl.LOCK_EX, item.nodeid)
        try:
            _take(self.lock, want, item.nodeid)
            self.held = want
        finally:
            if want == fcntl.LOCK_SH:
                fcntl.flock(self.gate, fcntl.LOCK_UN)

    def after(self, item, nextitem) -> None:
        """A timed test keeps the lock for the next one; an untimed test gives it back."""
        if self.held == fcntl.LOCK_EX and nextitem is not None and _timed(nextitem):
            return
        self.release()

    def release(self) -> None:
        if self.held is not None:
            fcntl.flock(self.lock, fcntl.LOCK_UN)
            if self.held == fcntl.LOCK_EX:
                fcntl.flock(self.gate, fcntl.LOCK_UN)
            self.held = None


def _timed(item) -> bool:
    return item.get_closest_marker("timed") is not None


def _take(f, how: int, what: str) -> None:
    deadline = time.monotonic() + ALONE_WAIT_S
    while True:
        try:
            fcntl.flock(f, how | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: waited {ALONE_WAIT_S} s for the other pytest worker's tests") from None
            time.sleep(0.05)


_ALONE = pytest.StashKey[_Alone]()


# outside pytest-timeout's wrapper: the wait for a turn is not the test's time
@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    alone = item.config.stash.get(_ALONE, None)
    if alone is not None:
        alone.before(item)
    try:
        yield
    finally:
        if alone is not None:
            alone.after(item, nextitem)


def _gone(pid: int) -> bool:
    return pid != os.getpid() and not os.path.exists(f"/proc/{pid}")


def _left_behind() -> set[str]:
    """What the suite must never leave: slipstream's shared-memory segments, emulated clusters'
    namespaces and temporary directories whose creating process is gone (or is this one), torch
    extension build locks, and torch.distributed.run's log directories (compared with the
    run's start by the caller)."""
    from slipstream.core_comm.collectives.segment import SHM_DIR
    from slipstream.plugins.deepspeed.build_lock import lock_files

    found = {f"build lock {path}" for path in lock_files()}
    tmp = tempfile.gettempdir()
    for n in os.listdir(tmp):
        m = re.match(r"slipstream-\w+-(\d+)-", n)
        if n.startswith("torchelastic_") or (m and _gone(int(m[1]))):
            found.add(f"directory {tmp}/{n}")
    names = os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []
    found |= {f"segment {SHM_DIR}/{n}" for n in names if (m := re.match(r"slipstream-(\d+)-", n)) and _gone(int(m[1]))}
    if shutil.which("ip") and os.geteuid() == 0:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=60).stdout
        found |= {f"namespace {ns}" for ns in (line.split()[0] for line in out.splitlines() if line.strip())
                  if (m := re.match(r"slipstream-(\d+)-", ns)) and _gone(int(m[1]))}
    return found


def _worker(config) -> bool:
    """A pytest-xdist worker (``-n``): its session ends while the others' tests still run, so
    the run's controller alone compares what was left, once every worker has finished."""
    return hasattr(config, "workerinput")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """``-n`` without ``--dist``: loadgroup, so that the timed tests run on one worker (_Alone)."""
    if getattr(config.option, "numprocesses", None) and config.option.dist == "no":
        config.option.dist = "loadgroup"


def pytest_sessionstart(session):
    if not _worker(session.config):
        session.config.stash[_BEFORE] = _left_behind()
    else:  # the run's temporary root, shared by its workers (pytest removes it)
        session.config.stash[_ALONE] = _Alone(str(session.config._tmp_path_factory.getbasetemp().parent))


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when it left a segment, a namespace, a directory or a build lock behind."""
    if _worker(session.config):
        return
    left = _left_behind() - session.config.stash.get(_BEFORE, set())
    if left:
        sys.__stderr__.write("\nthe tests left behind (the run fails):\n" + "".join(f"  {x}\n" for x in sorted(left)))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[set]()
