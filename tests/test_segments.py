"""Shared-memory segments: only what slipstream created is ever removed."""

import os
import subprocess
import sys

import pytest
import torch

from _dist import run_ranks
from slipstream.core_comm.collectives.segment import SHM_DIR, segment_name, sweep_stale

pytestmark = pytest.mark.faults


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_sweep_removes_only_our_segments_of_dead_processes(tmp_path):
    dead, alive = _dead_pid(), os.getpid()
    stale = tmp_path / segment_name(dead)
    live = tmp_path / segment_name(alive)
    foreign = [tmp_path / "slipstream-notapid-0123", tmp_path / f"slipstream-{dead}-short",
               tmp_path / f"torch_{dead}_segment", tmp_path / f"other-{segment_name(dead)}"]
    for path in (stale, live, *foreign):
        path.write_bytes(b"x")
    assert sweep_stale(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and all(p.exists() for p in foreign)


def test_env_clean_removes_them_and_says_which(tmp_path, monkeypatch, capsys):
    from slipstream.cli import main
    from slipstream.core_comm.collectives import segment as _shm_segment

    stale = tmp_path / segment_name(_dead_pid())
    stale.write_bytes(b"x")
    monkeypatch.setattr(_shm_segment.sweep_stale, "__defaults__", (str(tmp_path),))
    assert main(["env", "--clean"]) == 0
    assert not stale.exists() and str(stale) in capsys.readouterr().out


def _name_taken(rank, world, taken):
    """Group rank 0's new segment name is already taken (by a file that is not ours)."""
    from slipstream.core_comm import Communicator, CommConfig
    from slipstream.core_comm.collectives import segment as _shm_segment

    _shm_segment.segment_name = lambda pid: os.path.basename(taken)
    comm = Communicator(None, config=CommConfig(timeout_s=20))
    x = torch.full((1000,), float(rank + 1))
    comm.all_reduce(x)  # the stock path: every rank learnt that the set-up failed
    comm.close()
    return comm.unavailable, bool(torch.all(x == 3))


def test_a_taken_segment_name_is_left_alone_and_every_rank_falls_back():
    taken = os.path.join(SHM_DIR, segment_name(os.getpid()))
    with open(taken, "wb") as f:
        f.write(b"not ours")
    try:
        for why, right in run_ranks(_name_taken, 2, taken, rank_env=[{"SLIPSTREAM_NODE": "0"}] * 2, timeout=60):
            assert "File exists" in why and right
        with open(taken, "rb") as f:
            assert f.read() == b"not ours"
    finally:
        os.unlink(taken)
