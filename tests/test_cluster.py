"""The emulated multi-node cluster: rate parsing, spec validation, namespaces, launching."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from slipstream.cluster import ClusterSpec, EmulatedCluster, LaunchError, _netns, launch, parse_rate
from slipstream.cluster._impair import Impairment

# Each rank allreduces (rank + 1) and records what it saw.
_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    if os.environ.get("FAIL_RANK") == str(rank):
        sys.exit(3)
    record = dict(rank=rank, world=dist.get_world_size(), sum=t[0].item(),
                  node=os.environ.get("SLIPSTREAM_NODE"), ifname=os.environ.get("GLOO_SOCKET_IFNAME"),
                  cpus=sorted(os.sched_getaffinity(0)))
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()
    """
)


def _ours() -> list[str]:
    """Namespaces made by this process (other processes may run clusters meanwhile)."""
    return [n for n in _netns.list_ns() if n.startswith(f"slipstream-{os.getpid()}-")]


def _run_worker(tmp_path, spec, **kw) -> list[dict]:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    launch([str(script), str(tmp_path)], spec, timeout=120, **kw)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(spec.world_size)]


@pytest.mark.parametrize(
    "text, bps",
    [("1gbit", 1e9), ("100mbit", 1e8), ("125mbps", 1e9), ("1.5kbit", 1500), ("1gibit", 2**30),
     ("800", 800), ("10Gbit", 1e10)],
)
def test_parse_rate_follows_tc_units(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text", ["", "fast", "1 gigabit", "-1gbit", "0mbit"])
def test_parse_rate_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_rate(text)


@pytest.mark.parametrize(
    "kwargs",
    [dict(nodes=0), dict(ranks_per_node=0), dict(nodes=1, link="1gbit"), dict(nodes=2, link="x"),
     dict(nodes=2, per_connection_rate="100mbit"),
     dict(nodes=2, link="100mbit", per_connection_rate="1gbit"),
     dict(nodes=2, link="1gbit", capped_ports=range(29490, 29510)),
     dict(nodes=1, impair="loss 1%"), dict(nodes=2, impair=""), dict(nodes=2, impair="loss 100%"),
     dict(nodes=2, impair="reorder 5%"), dict(nodes=2, impair="delay 5ms 10ms"), dict(nodes=2, impair="jitter 3ms")],
)
def test_spec_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        ClusterSpec(**kwargs)


def test_an_impairment_reads_netems_words():
    spec = ClusterSpec(nodes=2, impair="delay 50ms 20ms, loss 1.5% seed 7")
    assert spec.impairment == Impairment(loss=0.015, delay_s=0.05, jitter_s=0.02, seed=7)
    assert ClusterSpec(nodes=2, impair="delay 10ms reorder 25%").impairment == Impairment(delay_s=0.01, reorder=0.25)


def test_a_hung_ip_command_fails_naming_it_within_the_bound(monkeypatch):
    monkeypatch.setattr(_netns, "COMMAND_TIMEOUT_S", 0.3)
    started = time.monotonic()
    with pytest.raises(_netns.NetnsError, match=r"`sleep 30` did not finish within 0.3 s"):
        _netns.run("sleep", "30")
    assert time.monotonic() - started < 10


def test_single_node_launch_needs_no_namespaces(tmp_path):
    seen = _run_worker(tmp_path, ClusterSpec(nodes=1, ranks_per_node=2))
    assert [s["sum"] for s in seen] == [3.0, 3.0]


@pytest.mark.faults
def test_failing_rank_fails_the_launch(tmp_path):
    with pytest.raises(LaunchError, match="node 0"):
        _run_worker(tmp_path, ClusterSpec(nodes=1, ranks_per_node=2), env={"FAIL_RANK": "1"})


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.parametrize("pin", [False, True], ids=["shared-cpus", "pinned"])
def test_two_nodes_allreduce_across_the_link(tmp_path, pin):
    spec = ClusterSpec(nodes=2, ranks_per_node=2, link="1gbit", pin_nodes=pin)
    seen = _run_worker(tmp_path, spec)
    assert [s["sum"] for s in seen] == [10.0] * 4
    assert [s["node"] for s in seen] == ["0", "0", "1", "1"]
    assert {s["ifname"] for s in seen} == {EmulatedCluster.iface}
    cpus = sorted(os.sched_getaffinity(0))
    by_node = [{tuple(s["cpus"]) for s in seen if s["node"] == n} for n in "01"]
    assert all(len(b) == 1 for b in by_node), by_node  # a node's ranks share their CPUs
    (node0,), (node1,) = by_node
    if not pin:
        assert list(node0) == list(node1) == cpus
    elif len(cpus) >= 2:  # each node on its own half of this process's CPUs
        assert set(node0).isdisjoint(node1) and len(node0) == len(node1) == len(cpus) // 2, by_node
    assert not _ours()


@pytest.mark.netns
def test_link_is_shaped_at_the_configured_rate_both_ways():
    with EmulatedCluster(ClusterSpec(nodes=2, link="100mbit")) as cluster:
        for node_ns in cluster.namespaces:
            assert "tbf" in (out := _netns.run("tc", "-s", "qdisc", "show", "dev", cluster.iface, ns=node_ns))
            assert "rate 100Mbit" in out
        switch = _netns.run("tc", "qdisc", "show", ns=cluster.switch_namespace)
        assert switch.count("rate 100Mbit") == 2
        assert len(set(cluster.node_ips)) == 2 and all(ip.startswith("10.213.") for ip in cluster.node_ips)


_LISTEN = "import socket,sys\ns=socket.create_server((sys.argv[1],5300),backlog=64)\nprint('ready',flush=True)\n" \
          "while True:\n    s.accept()[0].close()"
_CONNECT = "import socket,sys,time\nfor _ in range(5):\n    t=time.perf_counter()\n" \
           "    socket.create_connection((sys.argv[1],5300),timeout=10).close()\n    print(time.perf_counter()-t)"


def _connect_times(cluster: EmulatedCluster) -> list[float]:
    """Seconds each of 5 TCP connections from node 1 to node 0 took to open (one round trip)."""
    listener = subprocess.Popen(cluster.node_command(0, [sys.executable, "-c", _LISTEN, cluster.node_ips[0]]),
                                stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "ready"
        out = subprocess.run(cluster.node_command(1, [sys.executable, "-c", _CONNECT, cluster.node_ips[0]]),
                             capture_output=True, text=True, timeout=60, check=True).stdout
    finally:
        listener.kill()
        listener.wait()
    return [float(line) for line in out.split()]


@pytest.mark.netns
def _settled(cluster, within_s: float = 10.0) -> dict:
    """The forwarder's counters once two readings 0.6 s apart agree (it writes them every 0.5 s,
    idle or not): the traffic has stopped and the last write is in."""
    deadline, last = time.monotonic() + within_s, None
    while time.monotonic() < deadline:
        time.sleep(0.6)
        stats = cluster.impair_stats
        if stats == last:
            return stats
        last = stats
    raise AssertionError(f"the forwarder's counters still changing after {within_s} s: {last}")


@pytest.mark.slow
def test_an_impaired_link_delays_and_drops_what_each_node_sends():
    with EmulatedCluster(ClusterSpec(nodes=2, link="1gbit", impair="delay 30ms, loss 5%, seed 1")) as cluster:
        connects = _connect_times(cluster)
        cluster.measure_throughput(nbytes=4 << 20)  # completes: TCP sends again what was lost
        stats = _settled(cluster)
        stats_file, switch = cluster._stats_path(), cluster.switch_namespace
        forwarder = _netns.ns_pids(switch)
    assert min(connects) >= 0.06, connects  # the SYN and the SYN-ACK, each held 30 ms
    frames, dropped = stats["frames"], stats["dropped"]
    assert frames > 2000 and abs(dropped - 0.05 * frames) <= 5 * (frames * 0.05 * 0.95) ** 0.5, stats
    assert stats["delayed"] == frames - dropped - stats["overflowed"], stats
    assert forwarder and not any(_netns._alive(pid) for pid in forwarder)
    assert not os.path.exists(stats_file) and not _ours()


@pytest.mark.netns
def test_per_connection_cap_installs_one_class_per_port():
    spec = ClusterSpec(nodes=2, link="1gbit", per_connection_rate="300mbit", capped_ports=range(20000, 20004))
    with EmulatedCluster(spec) as cluster:
        classes = _netns.run("tc", "class", "show", "dev", cluster.iface, ns=cluster.namespaces[0])
        assert classes.count("ceil 300Mbit") == 4
        assert "rate 1Gbit ceil 1Gbit" in classes


@pytest.mark.faults
@pytest.mark.netns
def test_namespaces_are_deleted_after_normal_exit_and_after_an_error():
    with EmulatedCluster(ClusterSpec(nodes=3, link="1gbit")) as cluster:
        made = set(cluster.namespaces) | {cluster.switch_namespace}
        assert made <= set(_netns.list_ns())
    assert not made & set(_netns.list_ns())
    with pytest.raises(KeyError):
        with EmulatedCluster(ClusterSpec(nodes=2)) as cluster:
            made = set(cluster.namespaces) | {cluster.switch_namespace}
            raise KeyError("boom")
    assert not made & set(_netns.list_ns())
    assert not _ours()


@pytest.mark.faults
@pytest.mark.netns
def test_failed_enter_removes_what_it_made(monkeypatch):
    def broken(*args, **kwargs):
        raise _netns.NetnsError("injected")

    monkeypatch.setattr(_netns, "shape_egress", broken)
    with pytest.raises(_netns.NetnsError, match="injected"):
        with EmulatedCluster(ClusterSpec(nodes=2, link="1gbit")):
            pass
    assert not _ours()


def test_cluster_without_root_says_why(monkeypatch):
    monkeypatch.setattr(_netns, "missing_privileges", lambda: "needs root, as it says")
    with pytest.raises(_netns.NetnsError, match="needs root"):
        with EmulatedCluster(ClusterSpec(nodes=2)):
            pass


@pytest.mark.faults
def test_timeout_kills_every_rank(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import os, sys, time\nopen(sys.argv[1] + f'/{os.getpid()}', 'w').close()\ntime.sleep(300)\n")
    with pytest.raises(LaunchError, match="timed out"):
        launch([str(script), str(tmp_path)], ClusterSpec(nodes=1, ranks_per_node=2), timeout=4)
    pids = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]
    assert len(pids) == 2
    for pid in pids:
        assert not _netns._alive(pid)
