"""Shared-memory segments: only what slipstream created is ever removed."""

import os
import subprocess
import sys

from slipstream.core_comm._shm_segment import segment_name, sweep_stale


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
    from slipstream.core_comm import _shm_segment

    stale = tmp_path / segment_name(_dead_pid())
    stale.write_bytes(b"x")
    monkeypatch.setattr(_shm_segment.sweep_stale, "__defaults__", (str(tmp_path),))
    assert main(["env", "--clean"]) == 0
    assert not stale.exists() and str(stale) in capsys.readouterr().out
