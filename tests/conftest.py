import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile

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
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; none on this machine"))
        if "netns" in item.keywords and netns_reason:
            item.add_marker(pytest.mark.skip(reason=netns_reason))


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


def pytest_sessionstart(session):
    if not _worker(session.config):
        session.config.stash[_BEFORE] = _left_behind()


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when it left a segment, a namespace, a directory or a build lock behind."""
    if _worker(session.config):
        return
    left = _left_behind() - session.config.stash.get(_BEFORE, set())
    if left:
        sys.__stderr__.write("\nthe tests left behind (the run fails):\n" + "".join(f"  {x}\n" for x in sorted(left)))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[set]()


@pytest.fixture
def new_compile_graphs(monkeypatch):
    """Graphs that no earlier compile (of this run, or an earlier run on this machine) can have
    cached: a key tag of this test's own, in this process and in the processes it starts. The
    kernels inductor builds stay in the machine's cache, shared: g++ is the cold compile's time
    (about 1 s a kernel on 2 cores), and a kernel's source is its key, whatever graph holds it."""
    import uuid

    import torch

    tag = f"test-{uuid.uuid4().hex}"
    monkeypatch.setenv("TORCH_COMPILE_CACHE_KEY_TAG", tag)
    # torch's own patch: monkeypatch.setattr (pytest 9.2) would delete the entry at undo, as the
    # config module keeps it outside its __dict__
    with torch.compiler.config.patch(cache_key_tag=tag):
        yield tag
