"""Stopping a job: SIGTERM or SIGINT to ``slipstream finetune`` stops every rank within seconds."""

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.faults


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in os.listdir(f"/proc/{parent}/task") if os.path.isdir(f"/proc/{parent}/task") else ():
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            found.update(kids)
            todo.extend(kids)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _netns() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout


@pytest.mark.parametrize("nodes", [1, pytest.param(2, marks=pytest.mark.netns)])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_stops_every_rank(tmp_path, sig, nodes):
    before = _netns() if nodes > 1 else ""
    per_node = 2 if nodes == 1 else 1
    proc = subprocess.Popen(
        [sys.executable, "-m", "slipstream.cli", "finetune", "--steps", "200", "--samples", "64",
         "--max-length", "128", "--nodes", str(nodes), "--nproc", str(per_node),
         "--output-dir", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
    )
    ranks: set[int] = set()
    expected = nodes * (1 + per_node)  # each node's torchrun and its ranks
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(ranks) < expected:
        time.sleep(0.5)
        ranks = _descendants(proc.pid)
    assert len(ranks) >= expected, f"the ranks did not start: {ranks}"
    time.sleep(3)  # inside the training loop
    ranks = _descendants(proc.pid)
    sent = time.monotonic()
    proc.send_signal(sig)
    proc.communicate(timeout=30)
    deadline = sent + 15
    while time.monotonic() < deadline and any(_alive(p) for p in ranks):
        time.sleep(0.2)
    assert proc.returncode != 0
    assert not [p for p in ranks if _alive(p)], "ranks still running after the launcher stopped"
    if nodes > 1:
        assert _netns() == before, "the emulated nodes' namespaces were not deleted"
