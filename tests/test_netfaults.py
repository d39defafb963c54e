"""Network faults on the emulated cluster (``pytest -m netfaults``): the link between two nodes
loses, delays or reorders packets, or goes down, while collectives or training steps cross it.

- Loss of 1% and 5% of the packets, a delay of 50 ms with 20 ms of jitter, reordering (25% of
  the packets overtaking the rest, delayed 10 ms): every collective completes, its result exact
  (integer values, computed on the rank), nothing raised; each stack's training steps give the
  losses of a clean link, bit for bit.
- Down for 2 s, inside the timeout: the same, and the stall shows in the slowest round.
- Down past the timeout: every rank fails within 1.2x the timeout of the link going down,
  naming the peer it waited for; no shared-memory segment of the job is left; the same job
  started again on the restored link succeeds.

Each case runs 2 emulated nodes x 2 ranks (``slipstream.cluster``) with the default transport
and with 4 connections per peer. The link is cut at the switch's port towards node 1, as a
pulled cable or a failed switch port would. This kernel has no ``netem``: loss, delay and
reordering come from the cluster's forwarder in user space (``ClusterSpec.impair``), on the
frames each node sends, from the cluster's start (rendezvous included).

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


def _run(tmp_path: Path, *, down_s: float | None = None, timeout_s: float = 30.0, env: dict,
         impair: str | None = None, hold_s: float = 0.0, stack: str | None = None) -> dict:
    """Start 2 nodes x 2 ranks (running ``stack``'s training steps, or collectives), cut node 1's
    link for ``down_s`` (None: not at all) once every rank has run a round, restore it, wait
    ``hold_s``, then ask the ranks to stop. ``impair``: what the links do all along (netem's
    words, ``ClusterSpec.impair``). Each rank's exit code, exit time, output and record
    (``_netfault_worker.py``), when the link went down, and the impairing forwarder's counters."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = ClusterSpec(nodes=2, ranks_per_node=2, link="1gbit", impair=impair)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM")}
    base.update(WORLD_SIZE="4", MASTER_PORT=str(PORT), OMP_NUM_THREADS="1", SLIPSTREAM_TIMEOUT_S=str(timeout_s),
                **env)
    procs, logs, ended, stats = [], [], {}, {}
    argv = [sys.executable, WORKER, str(tmp_path), *([stack] if stack else [])]
    with EmulatedCluster(spec) as cluster:
        try:
            for rank in range(4):
                node = rank // 2
                log = open(tmp_path / f"rank{rank}.log", "w+")
                rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank % 2), SLIPSTREAM_NODE=str(node),
                                MASTER_ADDR=cluster.node_ips[0], GLOO_SOCKET_IFNAME=cluster.iface)
                procs.append(subprocess.Popen(cluster.node_command(node, argv),
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
            _note_ends(procs, ended, until=time.time() + hold_s)
            (tmp_path / "stop").touch()
            _note_ends(procs, ended, until=time.time() + 90)
            stats = cluster.impair_stats if impair else {}
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
            "segments": _segments_of({p.pid for p in procs}), "impair": stats}


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
        assert record["slowest_round_s"] >= 1.5, record  # a round stalled across the cut, and completed
    assert not res["segments"], f"segments left: {res['segments']}"
    _report({"case": "link down 2 s", "env": env, "survived": True, "results_equal": True,
             "slowest_call_s": round(max(r["slowest_s"] for r in res["records"]), 2),
             "rounds": min(r["rounds"] for r in res["records"])})


# Who a rank names when the link is gone: the peer it waited for (across the link, or its
# node's leader, who waited across it).
NAMED = r"rank(\(s\))? \d"


@pytest.mark.parametrize("env", TRANSPORTS)
@pytest.mark.slow
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


IMPAIRMENTS = ["loss 1%", "loss 5%", "delay 50ms 20ms", "delay 10ms reorder 25%"]


def _check_impaired(stats: dict, impair: str) -> None:
    """The forwarder did to the frames what ``impair`` says (5 binomial standard deviations)."""
    frames = stats["frames"] - stats["overflowed"]
    assert frames > 1000, stats
    for word, key in (("loss", "dropped"), ("reorder", "ahead")):
        if m := re.search(word + r" (\d+)%", impair):
            p = int(m.group(1)) / 100
            assert abs(stats[key] - p * frames) <= 5 * (frames * p * (1 - p)) ** 0.5, (impair, stats)
    if impair.startswith("delay"):
        assert stats["delayed"] + stats["ahead"] == frames, stats


@pytest.mark.matrix  # under -m netfaults / -m faults only: the default run keeps the link cut
@pytest.mark.parametrize("env", TRANSPORTS)
@pytest.mark.parametrize("impair", IMPAIRMENTS)
def test_an_impaired_link_is_survived_with_exact_results(tmp_path, impair, env):
    res = _run(tmp_path, impair=impair, hold_s=2.0, env=env)
    out = "\n".join(res["out"])
    assert res["rc"] == [0, 0, 0, 0], f"a rank failed: {res['rc']}\n{out}"
    for record in res["records"]:
        assert record is not None and record["wrong"] == [], record
        assert record["rounds"] >= 2, record
    assert not res["segments"], f"segments left: {res['segments']}"
    _check_impaired(res["impair"], impair)
    _report({"case": impair, "env": env, "survived": True, "results_equal": True, "frames": res["impair"],
             "slowest_call_s": round(max(r["slowest_s"] for r in res["records"]), 2),
             "rounds": min(r["rounds"] for r in res["records"])})


# Training: each step paced to 0.25 s at least, so that the 2 s cut lands among the first 20.
ROUNDS, PACE_S = 24, "0.25"
_CLEAN: dict[str, list[list[float]]] = {}  # stack -> each rank's losses on a clean link


def _losses(tmp_path: Path, stack: str, **fault) -> tuple[dict, list[list[float]]]:
    env = {"NETFAULT_ROUNDS": str(ROUNDS), "NETFAULT_PACE_S": PACE_S}
    res = _run(tmp_path, env=env, stack=stack, **fault)
    assert res["rc"] == [0, 0, 0, 0], f"{stack}: a rank failed: {res['rc']}\n" + "\n".join(res["out"])
    assert not res["segments"], f"segments left: {res['segments']}"
    return res, [r["losses"] for r in res["records"]]


@pytest.mark.matrix
@pytest.mark.parametrize("fault", [*IMPAIRMENTS, "down 2 s"])
@pytest.mark.parametrize("stack", ["deepspeed", "fsdp", "megatron"])
def test_training_steps_of_each_stack_survive_with_the_losses_of_a_clean_link(tmp_path, stack, fault):
    pytest.importorskip("deepspeed" if stack == "deepspeed" else "torch")
    if stack == "megatron":
        pytest.importorskip("megatron.core")
    if stack not in _CLEAN:
        _CLEAN[stack] = _losses(tmp_path / "clean", stack, hold_s=120.0)[1]  # ends at ROUNDS
        assert all(len(losses) == ROUNDS for losses in _CLEAN[stack]), _CLEAN[stack]
    args = {"down_s": 2.0} if fault.startswith("down") else {"impair": fault, "hold_s": 1.0}
    res, losses = _losses(tmp_path / "fault", stack, **args)
    for rank, (got, clean) in enumerate(zip(losses, _CLEAN[stack])):
        assert len(got) >= 2 and got == clean[:len(got)], f"{stack} rank {rank} under {fault}: {got} != {clean}"
    if "impair" in args:
        _check_impaired(res["impair"], fault)
    else:
        assert max(r["slowest_round_s"] for r in res["records"]) >= 1.5, res["records"]  # a round spanned the cut
    _report({"case": f"{stack} training, {fault}", "survived": True, "losses_equal": True,
             "steps": min(len(got) for got in losses),
             "slowest_step_s": round(max(r["slowest_s"] for r in res["records"]), 2),
             "slowest_round_s": round(max(r["slowest_round_s"] for r in res["records"]), 2)})
