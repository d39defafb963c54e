"""The node launcher that forks its ranks (``slipstream.cluster._forkrun``), against
``torch.distributed.run``: the same worker variables and the same results for a script and a
module, torchrun's failure rule, signals reaching the ranks, and a rank's interpreter exit."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from slipstream.cluster import ClusterSpec
from slipstream.cluster._forkrun import BOOTSTRAP, top_level_imports
from slipstream.cluster._launcher import _with_log_dir
from slipstream.cluster.emulated import node_launcher

PROBE = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist

    KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "GROUP_WORLD_SIZE",
            "ROLE_WORLD_SIZE", "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
            "TORCHELASTIC_USE_AGENT_STORE")
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    out = {"env": {k: os.environ.get(k) for k in KEYS}, "sum": t.item(), "argv": sys.argv[2:],
           "name": __name__, "threads": torch.get_num_threads()}
    dist.destroy_process_group()
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(out, f)
""")


def _launch(how: str, entry: list[str], cwd, *, timeout: float = 120, **popen) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLIPSTREAM_LAUNCHER": how, "GLOO_SOCKET_IFNAME": "lo"}
    with pytest.MonkeyPatch.context() as mp:  # the command is chosen here, from this process's environment
        mp.setenv("SLIPSTREAM_LAUNCHER", how)
        argv = _with_log_dir(node_launcher(ClusterSpec(nodes=1, ranks_per_node=2), 0, None, entry), str(cwd / "logs"))
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **popen)


def _ranks(out_dir) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("form", ["script", "module"])
def test_forked_ranks_get_torchruns_variables_and_results(tmp_path, form):
    (tmp_path / "probe_entry.py").write_text(PROBE)
    seen = {}
    for how in ("torchrun", "fork"):
        out = tmp_path / how
        out.mkdir()
        entry = [str(tmp_path / "probe_entry.py")] if form == "script" else ["-m", "probe_entry"]
        done = _launch(how, [*entry, str(out), "--flag"], tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert ("forked after importing" in done.stderr) == (how == "fork"), done.stderr
        seen[how] = _ranks(out)
    for stock, ours in zip(seen["torchrun"], seen["fork"]):
        assert ours == stock
    assert [r["sum"] for r in seen["fork"]] == [3.0, 3.0]
    assert [r["env"]["RANK"] for r in seen["fork"]] == ["0", "1"]
    assert seen["fork"][0]["name"] == "__main__" and seen["fork"][0]["argv"] == ["--flag"]


def test_imports_that_start_a_thread_hand_the_node_to_torchrun(tmp_path):
    """A forked child holds none of its parent's threads: where the ranks' imports start one,
    the launcher runs torch.distributed.run instead, and the job's results are the same."""
    (tmp_path / "threader.py").write_text("import threading, time\n"
                                           "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    (tmp_path / "probe_entry.py").write_text("import threader\n" + PROBE)
    out = tmp_path / "out"
    out.mkdir()
    done = _launch("fork", [str(tmp_path / "probe_entry.py"), str(out), "--flag"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "started 1 thread(s)" in done.stderr and "forked after importing" not in done.stderr
    assert [r["sum"] for r in _ranks(out)] == [3.0, 3.0]


def test_the_first_failed_rank_stops_the_others_and_is_named(tmp_path):
    (tmp_path / "fail.py").write_text(textwrap.dedent("""
        import os, sys, time
        with open(os.path.join(sys.argv[1], f"pid{os.environ['RANK']}"), "w") as f:
            f.write(str(os.getpid()))
        if os.environ["RANK"] == "1":
            time.sleep(0.5)
            sys.exit(3)
        time.sleep(120)
    """))
    start = time.monotonic()
    done = _launch("fork", [str(tmp_path / "fail.py"), str(tmp_path)], tmp_path, timeout=60)
    assert done.returncode == 1
    assert "rank 1 failed (exit code 3)" in done.stderr
    assert time.monotonic() - start < 30  # rank 0 was stopped, not waited for
    assert not os.path.exists(f"/proc/{(tmp_path / 'pid0').read_text()}")


def test_a_rank_ends_as_an_interpreter_does(tmp_path):
    """Non-daemon threads are joined and exit handlers run before a rank leaves; its exit code
    is what ``sys.exit`` gave; an exception is printed with exit code 1."""
    (tmp_path / "ending.py").write_text(textwrap.dedent("""
        import atexit, os, sys, threading, time
        d, rank = sys.argv[1], os.environ["RANK"]
        def late():
            time.sleep(0.5)
            open(os.path.join(d, f"thread{rank}"), "w").close()
        threading.Thread(target=late).start()
        atexit.register(lambda: open(os.path.join(d, f"atexit{rank}"), "w").close())
        if sys.argv[2] == "raise":
            raise RuntimeError("a rank's own error")
    """))
    done = _launch("fork", [str(tmp_path / "ending.py"), str(tmp_path), "ok"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert {p.name for p in tmp_path.iterdir()} >= {"thread0", "thread1", "atexit0", "atexit1"}
    failed = _launch("fork", [str(tmp_path / "ending.py"), str(tmp_path), "raise"], tmp_path)
    assert failed.returncode == 1
    assert "RuntimeError: a rank's own error" in failed.stderr and "failed (exit code 1)" in failed.stderr


def test_sigterm_to_the_launcher_stops_every_rank(tmp_path, monkeypatch):
    (tmp_path / "sleep.py").write_text(textwrap.dedent("""
        import os, sys, time
        with open(os.path.join(sys.argv[1], f"pid{os.environ['RANK']}"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)
    """))
    monkeypatch.setenv("SLIPSTREAM_LAUNCHER", "fork")  # read here, where the command is chosen
    env = dict(os.environ)
    argv = node_launcher(ClusterSpec(nodes=1, ranks_per_node=2), 0, None, [str(tmp_path / "sleep.py"), str(tmp_path)])
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks did not start"
            time.sleep(0.1)
        pids = [(tmp_path / f"pid{r}").read_text() for r in range(2)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    finally:
        proc.kill()
        proc.wait()


def test_a_launcher_that_cannot_host_the_store_leaves_no_rank_behind(tmp_path):
    (tmp_path / "sleep.py").write_text("import time\ntime.sleep(120)\n")
    with _listening_on_every_address() as taken:
        argv = [sys.executable, "-c", BOOTSTRAP, "--nproc-per-node", "2", "--master-port",
                str(taken.getsockname()[1]), str(tmp_path / "sleep.py")]
        done = subprocess.run(argv, cwd=tmp_path, env={**os.environ}, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "EADDRINUSE" in done.stderr, done.stderr
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline(pid).count(str(tmp_path / "sleep.py"))]
    assert not left, left


def _listening_on_every_address() -> socket.socket:
    """A socket holding a port on every address, as the store binds its own."""
    try:
        taken = socket.socket(socket.AF_INET6)
        taken.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        taken.bind(("::", 0))
    except OSError:  # no IPv6 here
        taken = socket.socket()
        taken.bind(("0.0.0.0", 0))
    taken.listen()
    return taken


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def test_the_launcher_choice_is_read_from_the_environment(monkeypatch):
    spec = ClusterSpec(nodes=1, ranks_per_node=2)
    monkeypatch.setenv("SLIPSTREAM_LAUNCHER", "torchrun")
    assert node_launcher(spec, 0, None, ["x.py"])[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    monkeypatch.setenv("SLIPSTREAM_LAUNCHER", "fork")
    assert node_launcher(spec, 0, None, ["x.py"], ["deepspeed"])[1:3] == ["-c", BOOTSTRAP]
    monkeypatch.setenv("SLIPSTREAM_LAUNCHER", "forks")
    with pytest.raises(ValueError, match="SLIPSTREAM_LAUNCHER='forks'"):
        node_launcher(spec, 0, None, ["x.py"])


def test_top_level_imports_are_what_the_entry_imports_before_it_runs(tmp_path):
    path = tmp_path / "entry.py"
    path.write_text(textwrap.dedent("""
        from __future__ import annotations
        import json, os.path
        from ..cluster.worker import run_worker
        from . import model
        def f():
            import deepspeed
        if __name__ == "__main__":
            import transformers
    """))
    assert top_level_imports(str(path), "slipstream.recipes") == [
        "json", "os.path", "slipstream.cluster.worker", "slipstream.cluster.worker.run_worker",
        "slipstream.recipes", "slipstream.recipes.model"]
