"""Network faults on the emulated cluster (``pytest -m netfaults``): the link between two nodes
goes down while collectives cross it.

- Down for 2 s, inside the timeout: every collective completes, its result exact (integer
  values, computed on the rank), nothing raised; the stall shows in the slowest call.
- Down past the timeout: every rank fails within 1.2x the timeout of the link going down,
  naming the peer it waited for; no shared-memory segment of the job is left; the same job
  started again on the restored link succeeds.

Each case runs 2 emulated nodes x 2 ranks (``slipstream.cluster``) with the default transport
and with 4 connections per peer. The link is cut at the switch's port towards node 1, as a
pulled cable or a failed switch port would. This kernel has no ``netem``, so packet loss,
delay and reordering are not emulated here.

The ranks are started one by one inside their node's namespace (not through ``launch``, which
stops every node once one fails: here each rank's own exit is measured).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slipstream.cluster import ClusterSpec, EmulatedCluster, _netns
from slipstream.core_comm.collectives.segment import SHM_DIR

pytestmark = [pytest.mark.netns, pytest.mark.faults, pytest.mark.netfaults]

WORKER = os.path.join(os.path.dirname(__file__), "_netfault_worker.py")
TIMEOUT_S = 5.0  # the outage case's SLIPSTREAM_TIMEOUT_S
MARGIN_S = 3.0  # a rank's interpreter teardown after the error, on a loaded 2-core machine
PORT = 29581


def _run(tmp_path: Path, *, down_s: float | None, timeout_s: float, env: dict) -> dict:
    """Start 2 nodes x 2 ranks, cut node 1's link for ``down_s`` (None: not at all) once every
    rank has run a round, restore it, then ask the ranks to stop. Each rank's exit code, exit
    time, output and record (``_netfault_worker.py``), and when the link went down."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = ClusterSpec(nodes=2, ranks_per_node=2, link="1gbit")
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM")}
    base.update(WORLD_SIZE="4", MASTER_PORT=str(PORT), OMP_NUM_THREADS="1", SLIPSTREAM_TIMEOUT_S=str(timeout_s),
                **env)
    procs, logs, ended = [], [], {}
    with EmulatedCluster(spec) as cluster:
        try:
            for rank in range(4):
                node = rank // 2
                log = open(tmp_path / f"rank{rank}.log", "w+")
                rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank % 2), SLIPSTREAM_NODE=str(node),
                                MASTER_ADDR=cluster.node_ips[0], GLOO_SOCKET_IFNAME=cluster.iface)
                procs.append(subprocess.Popen(cluster.node_command(node, [sys.executable, WORKER, str(tmp_path)]),
                                              env=rank_env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
                logs.append(log)
            _wait(lambda: all((tmp_path / f"ready{r}").exists() for r in range(4)) or _any_ended(procs), 120)
            assert not _any_ended(procs), "a rank ended before the fault:\n" + "\n".join(_outputs(logs))
            time.sleep(0.5)  # inside a round
            down = time.time()
            if down_s is not None:
                _netns.run("ip", "link", "set", "n1", "down", ns=cluster.switch_namespace)
                try:
                    _note_ends(procs, ended, until=down + down_s)
                finally:
                    _netns.run("ip", "link", "set", "n1", "up", ns=cluster.switch_namespace)
            (tmp_path / "stop").touch()
            _note_ends(procs, ended, until=time.time() + 90)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    outputs = _outputs(logs)
    for log in logs:
        log.close()
    records = [json.loads(f.read_text()) if (f := tmp_path / f"rank{r}.json").exists() else None for r in range(4)]
    return {"rc": [p.returncode for p in procs], "ended": ended, "out": outputs, "down": down, "records": records,
            "segments": _segments_of({p.pid for p in procs})}


def _report(entry: dict) -> None:
    """With ``SLIPSTREAM_FAULTS_REPORT=path``, append ``entry`` to ``path`` (a JSON line)."""
    path = os.environ.get("SLIPSTREAM_FAULTS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def _note_ends(procs, ended: dict, *, until: float) -> None:
    """Record when each rank exits, until ``until`` or until all have."""
    while time.time() < until and len(ended) < len(procs):
        for rank, p in enumerate(procs):
            if rank not in ended and p.poll() is not None:
                ended[rank] = time.time()
        time.sleep(0.02)
    if len(ended) < len(procs):
        time.sleep(max(0.0, until - time.time()))


def _wait(done, seconds: float) -> None:
    deadline = time.time() + seconds
    while not done():
        assert time.time() < deadline, f"not ready within {seconds:g} s"
        time.sleep(0.05)


def _any_ended(procs) -> bool:
    return any(p.poll() is not None for p in procs)


def _outputs(logs) -> list[str]:
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
    return texts


def _segments_of(pids: set[int]) -> list[str]:
    """Segments of the job's ranks (a segment's name carries its creator's pid)."""
    names = os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []
    return sorted(n for n in names if n.startswith("slipstream") and n.split("-")[1].isdigit()
                  and int(n.split("-")[1]) in pids)


# The default run takes the default transport; ``-m netfaults`` (or ``-m faults``) both.
TRANSPORTS = [pytest.param({}, id="default-transport"),
              pytest.param({"SLIPSTREAM_CONNECTIONS": "4"}, id="4-connections", marks=pytest.mark.matrix)]


@pytest.mark.parametrize("env", TRANSPORTS)
def test_a_link_down_for_2s_inside_the_timeout_is_survived_with_exact_results(tmp_path, env):
    res = _run(tmp_path, down_s=2.0, timeout_s=30.0, env=env)
    out = "\n".join(res["out"])
    assert res["rc"] == [0, 0, 0, 0], f"a rank failed: {res['rc']}\n{out}"
    for record in res["records"]:
        assert record is not None and record["wrong"] == [], record
        assert record["rounds"] >= 2, record  # rounds ran before and after the cut
        assert record["slowest_s"] >= 1.5, record  # a call stalled across the cut, and completed
    assert not res["segments"], f"segments left: {res['segments']}"
    _report({"case": "link down 2 s", "env": env, "survived": True, "results_equal": True,
             "slowest_call_s": round(max(r["slowest_s"] for r in res["records"]), 2),
             "rounds": min(r["rounds"] for r in res["records"])})


# Who a rank names when the link is gone: the peer it waited for (across the link, or its
# node's leader, who waited across it).
NAMED = r"rank(\(s\))? \d"


@pytest.mark.parametrize("env", TRANSPORTS)
def test_a_link_down_past_the_timeout_fails_every_rank_in_time_and_a_restart_succeeds(tmp_path, env):
    res = _run(tmp_path / "outage", down_s=3 * TIMEOUT_S, timeout_s=TIMEOUT_S, env=env)
    for rank, out in enumerate(res["out"]):
        assert res["rc"][rank] not in (0, None), f"rank {rank} did not fail:\n{out}"
        errors = re.findall(r"^ERROR (.*)$", out, re.M)
        raised = re.findall(r"^RAISED (\S+)$", out, re.M)
        assert errors and raised, f"rank {rank} reported no error:\n{out}"
        assert re.search(NAMED, errors[0]), f"rank {rank}'s error names no peer: {errors[0]}"
        assert float(raised[0]) - res["down"] <= 1.2 * TIMEOUT_S, \
            f"rank {rank} raised {float(raised[0]) - res['down']:.1f} s after the cut: {errors[0]}"
        assert res["ended"][rank] - res["down"] <= 1.2 * TIMEOUT_S + MARGIN_S, f"rank {rank} exited late"
    assert not res["segments"], f"segments left: {res['segments']}"
    raised = [float(re.findall(r"^RAISED (\S+)$", out, re.M)[0]) - res["down"] for out in res["out"]]
    _report({"case": f"link down past the {TIMEOUT_S:g} s timeout", "env": env, "failed_cleanly": True,
             "slowest_raise_s": round(max(raised), 2),
             "slowest_exit_s": round(max(res["ended"].values()) - res["down"], 2),
             "errors": sorted({re.findall(r"^ERROR (.*)$", out, re.M)[0][:100] for out in res["out"]})})
    again = _run(tmp_path / "restart", down_s=None, timeout_s=30.0, env=env)
    assert again["rc"] == [0, 0, 0, 0] and all(r and not r["wrong"] for r in again["records"]), again["out"]
