"""An emulated multi-node cluster on one machine: N nodes x M ranks, slow links between nodes.

Each node is a network namespace holding one end of a veth pair (``veth0``, address
``10.213.<c>.<node+1>/24``, ``c`` a third octet free among this machine's clusters); the other
ends sit on a bridge in a "switch" namespace. ``tc`` limits each node's link in both
directions: on the node's egress and on the switch's egress towards the node. Traffic between
ranks of one node goes to the node's own address and stays local (the kernel routes it over
loopback), traffic between nodes crosses two shaped links. Ranks are started by one launcher
per node inside its namespace (``node_launcher``: forked after one import of what they need,
or ``torch.distributed.run`` where an accelerator is visible), with
``SLIPSTREAM_NODE=<node>`` (so topology detection, and hence shared memory, follows the emulated
nodes) and ``GLOO_SOCKET_IFNAME=veth0``. With one node nothing is emulated: the
same launcher on loopback, no root needed. Every process runs the
launching interpreter (``sys.executable``) with the launcher's environment, so ranks import
``slipstream`` from where the launcher does (an installed package, editable or not).

Link rates, measured with ``python -m slipstream.cluster`` (32 MiB over TCP from
node 1 to node 0, goodput; 1448 payload bytes per 1514-byte frame make 95.6% of the rate
the most TCP can get; 2-core KVM guest, kernel 6.18):

    link      flows  measured          link      per-connection  flows  measured
    1gbit     1      958.8 Mbit/s      1gbit     300mbit         1      287.9 Mbit/s
    100mbit   1      95.8 Mbit/s       1gbit     300mbit         2      577.5 (289 + 289)
    none      1      ~13 Gbit/s        1gbit     300mbit         4      958.4 (4 x 241)
                                       1gbit     300mbit, port outside the range: 959.4

Per-connection caps use htb with one class per port of ``capped_ports`` and u32 filters on the
source and destination port; fq's ``maxrate`` (per-flow pacing) would need no port range, but
this kernel has neither fq nor netem (``tc qdisc add ... fq``: "Specified qdisc kind is
unknown"). Loss, delay and reordering (``impair``) go through a forwarder in user space instead
(``_forwarder.py``). A connection is capped when one of its ends
uses a port of the range, and capped on its own when no other connection uses that port: a
transport gives every connection its own listening port in the range, or binds its client
sockets there. Automatic (ephemeral) ports start at 32768, so the default range
20000-20063 never catches unrelated traffic.
"""

from __future__ import annotations

import atexit
import glob
import os
import re
import secrets
import select
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Mapping, Sequence

from . import _forkrun, _impair, _netns
from ._impair import Impairment, parse_impairment
from ._launcher import LaunchError, _restore_handlers, _run_nodes, _unwind_on_termination
from ._netns import NetnsError

__all__ = ["ClusterSpec", "EmulatedCluster", "LaunchError", "NetnsError", "launch", "parse_rate"]

_UNITS = {"": 1, "bit": 1, "bps": 8}
for _i, _p in enumerate("kmgt", start=1):
    _UNITS.update({f"{_p}bit": 1e3**_i, f"{_p}ibit": 1024**_i,
                   f"{_p}bps": 8 * 1e3**_i, f"{_p}ibps": 8 * 1024**_i})

_NAME = re.compile(r"slipstream-(\d+)-([0-9a-f]+)-(\d+)-(n\d+|sw)$")
_MASTER_PORT = 29500
_SUBNET = "10.213"
_FORWARDER_START_S = 30.0  # an interpreter's start on a loaded 2-core machine, with margin


def parse_rate(rate: str) -> float:
    """A tc rate (``"1gbit"``, ``"100mbit"``, ``"125mbps"``, ``"1gibit"``) in bits/s.

    As in tc, ``bit`` units are bits, ``bps`` units bytes, a bare number bits per second.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", str(rate).lower())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"not a positive tc rate: {rate!r} (e.g. '1gbit', '100mbit', '125mbps')")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass(kw_only=True, frozen=True)
class ClusterSpec:
    """Shape of an emulated cluster."""

    nodes: int = 1
    """Emulated nodes. Two or more need root and iproute2 (one network namespace each)."""
    ranks_per_node: int = 1
    """Processes per node (torchrun's ``--nproc-per-node``)."""
    link: str | None = None
    """tc rate of each node's link, each direction (``"1gbit"``); None leaves veth unlimited."""
    per_connection_rate: str | None = None
    """tc rate capping each connection that uses a port of ``capped_ports``; needs ``link``."""
    capped_ports: range = range(20000, 20064)
    """Ports with a per-connection cap, one htb class each (consecutive, at most 1024)."""
    impair: str | None = None
    """What each node's link does to the frames the node sends, in netem's words (``"loss 1%"``,
    ``"delay 50ms 20ms"``, ``"delay 10ms reorder 25%"``); done by a forwarder in user space,
    which also caps the rate (see ``_forwarder.py``). None: a clean link."""
    pin_nodes: bool = False
    """Run each node's ranks on their own share of this machine's CPUs (``taskset``), so that
    a node's compute, its ranks' waits and the kernel's network work they start (a veth
    transmit runs in the sender's softirq) stay on that node's cores."""

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.link is not None:
            parse_rate(self.link)
            if self.nodes == 1:
                raise ValueError("a link joins nodes: set nodes >= 2 or link=None")
        if self.per_connection_rate is not None:
            if self.link is None:
                raise ValueError("per_connection_rate caps connections under a link rate: set link")
            if parse_rate(self.per_connection_rate) > parse_rate(self.link):
                raise ValueError("per_connection_rate exceeds the link rate; it would cap nothing")
        if self.impair is not None:
            parse_impairment(self.impair)
            if self.nodes == 1:
                raise ValueError("impair acts on the links between nodes: set nodes >= 2 or impair=None")
        ports = self.capped_ports
        if ports.step != 1 or not 1 <= len(ports) <= 1024 or ports.start < 1 or ports.stop > 65536:
            raise ValueError(f"capped_ports must be 1-1024 consecutive ports, got {ports!r}")
        if _MASTER_PORT in ports:
            raise ValueError(f"capped_ports must not hold the launcher's port {_MASTER_PORT}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def link_bps(self) -> float | None:
        return None if self.link is None else parse_rate(self.link)

    @property
    def impairment(self) -> Impairment | None:
        return None if self.impair is None else parse_impairment(self.impair)

    @property
    def emulated(self) -> bool:
        """Whether nodes are network namespaces (else: one plain local node)."""
        return self.nodes > 1


# Clusters entered and not yet closed, closed at interpreter exit and on SIGTERM / SIGHUP.
_LIVE: dict[int, "EmulatedCluster"] = {}
_SAVED_HANDLERS: dict[int, object] = {}


def _close_all() -> None:
    for cluster in list(_LIVE.values()):
        cluster.close()


atexit.register(_close_all)


def _track(cluster: "EmulatedCluster", live: bool) -> None:
    if live:
        _LIVE[id(cluster)] = cluster
    else:
        _LIVE.pop(id(cluster), None)
    if threading.current_thread() is not threading.main_thread():
        return
    if _LIVE and not _SAVED_HANDLERS:
        _SAVED_HANDLERS.update(_unwind_on_termination())
    elif not _LIVE:
        _restore_handlers(_SAVED_HANDLERS)
        _SAVED_HANDLERS.clear()


class EmulatedCluster:
    """Context manager owning the namespaces of one emulated cluster.

    ``__enter__`` builds everything (and removes what it built if it fails half-way);
    ``__exit__`` kills whatever still runs in the namespaces and deletes them, which takes
    every veth and bridge with it. Names are ``slipstream-<pid>-<random>-<octet>-n<i>`` and
    ``...-sw``; on enter, namespaces of that form whose creating process is gone (a SIGKILLed
    run) are removed too.
    """

    iface = "veth0"
    """Interface name inside every node namespace."""

    __slots__ = ("spec", "_tag", "_octet", "_made", "_forwarder")

    def __init__(self, spec: ClusterSpec) -> None:
        if not spec.emulated:
            raise ValueError("an emulated cluster needs nodes >= 2; launch() runs one node locally")
        self.spec = spec
        self._tag: str | None = None  # name prefix, chosen on enter
        self._octet = 0  # third octet of this cluster's addresses
        self._made: list[str] = []  # namespaces created, in order
        self._forwarder: subprocess.Popen | None = None  # with ``impair``: the switch's forwarder

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Node namespace names, by node."""
        return tuple(f"{self._entered_tag()}-n{i}" for i in range(self.spec.nodes))

    @property
    def switch_namespace(self) -> str:
        return f"{self._entered_tag()}-sw"

    @property
    def node_ips(self) -> tuple[str, ...]:
        self._entered_tag()
        return tuple(f"{_SUBNET}.{self._octet}.{i + 1}" for i in range(self.spec.nodes))

    def _entered_tag(self) -> str:
        if self._tag is None:
            raise RuntimeError("the cluster exists only inside `with EmulatedCluster(spec):`")
        return self._tag

    def __enter__(self) -> "EmulatedCluster":
        reason = _netns.missing_privileges()
        if reason:
            raise NetnsError(reason)
        _track(self, True)
        try:
            existing = _netns.list_ns()
            _remove_stale(existing)
            used = {int(m.group(3)) for m in map(_NAME.match, existing) if m}
            self._octet = secrets.choice([c for c in range(1, 255) if c not in used] or [0])
            self._tag = f"slipstream-{os.getpid()}-{secrets.token_hex(3)}-{self._octet}"
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def impair_stats(self) -> dict:
        """The impairing forwarder's counters (``_forwarder.py``): frames the nodes sent, dropped,
        delayed, sent ahead of the delayed ones (``ahead``: reorder), dropped for a full queue
        (``overflowed``), the most held at once; written every 0.5 s."""
        if self.spec.impair is None:
            raise RuntimeError("this cluster's links are clean (ClusterSpec.impair is None)")
        return _impair.read_stats(self._stats_path())

    def _stats_path(self) -> str:
        return os.path.join(tempfile.gettempdir(), f"{self._entered_tag()}-impair.json")

    def close(self) -> None:
        """Kill what runs in our namespaces and delete them; idempotent."""
        if self._forwarder is not None:
            self._forwarder.kill()
            self._forwarder.wait()
            self._forwarder = None
            stats = self._stats_path()  # and a temporary copy, had the forwarder been killed writing it
            for path in (stats, *glob.glob(os.path.join(os.path.dirname(stats), f".{os.path.basename(stats)}.*.tmp"))):
                if os.path.exists(path):
                    os.remove(path)
        while self._made:
            _netns.del_ns(self._made.pop())
        _track(self, False)

    def _add_ns(self, name: str) -> None:
        self._made.append(name)  # before creating: a half-made namespace is still deleted
        _netns.add_ns(name)

    def _build(self) -> None:
        sw, run, spec = self.switch_namespace, _netns.run, self.spec
        self._add_ns(sw)
        run("ip", "link", "add", "br0", "type", "bridge", ns=sw)
        run("ip", "link", "set", "br0", "up", ns=sw)
        for i, (ns, ip) in enumerate(zip(self.namespaces, self.node_ips)):
            self._add_ns(ns)
            port = f"n{i}"
            _netns.add_veth(ns, self.iface, sw, port)
            if spec.impair is not None:  # the port's own bridge, joined to br0 by the forwarder
                run("ip", "link", "add", f"b{i}", "type", "bridge", ns=sw)
                run("ip", "link", "set", f"b{i}", "up", ns=sw)
            run("ip", "link", "set", port, "master", "br0" if spec.impair is None else f"b{i}", "up", ns=sw)
            run("ip", "addr", "add", f"{ip}/24", "dev", self.iface, ns=ns)
            run("ip", "link", "set", self.iface, "up", ns=ns)
            if spec.link is not None:  # both directions: the node's egress and the switch's towards it
                per_conn = None if spec.per_connection_rate is None else parse_rate(spec.per_connection_rate)
                for where, dev in ((ns, self.iface), (sw, port)):
                    _netns.shape_egress(where, dev, parse_rate(spec.link), per_connection_bps=per_conn,
                                        capped_ports=spec.capped_ports)
        if spec.impair is not None:
            self._start_forwarder()

    def _start_forwarder(self) -> None:
        """Start the impairing forwarder in the switch namespace; put its taps on the bridges."""
        sw, argv = self.switch_namespace, _impair.command(self.spec.nodes, self.spec.impairment, self._stats_path())
        self._forwarder = subprocess.Popen(["ip", "netns", "exec", sw, *argv], stdout=subprocess.PIPE, text=True)
        if not _says_ready(self._forwarder, _FORWARDER_START_S):
            raise NetnsError(f"the impairing forwarder did not start within {_FORWARDER_START_S:g} s "
                             f"(exit code {self._forwarder.poll()}; is /dev/net/tun there?)")
        for i in range(self.spec.nodes):
            for tap, bridge in zip(_impair.tap_names(i), ("br0", f"b{i}")):
                _netns.run("ip", "link", "set", tap, "txqueuelen", "10000", "master", bridge, "up", ns=sw)

    def node_command(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``node``'s namespace (on its CPUs with ``pin_nodes``)."""
        if self.spec.pin_nodes:
            cpus = sorted(os.sched_getaffinity(0))
            share = max(1, len(cpus) // self.spec.nodes)
            mine = [cpus[(node * share + k) % len(cpus)] for k in range(share)]
            argv = ["taskset", "-c", ",".join(map(str, mine)), *argv]
        return ["ip", "netns", "exec", self.namespaces[node], *argv]

    def launch(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
               timeout: float | None = None, preload: Sequence[str] = ()) -> None:
        """Run ``argv`` (a script and its arguments, or ``-m module ...``) on every rank.

        One node launcher per node inside its namespace (:func:`node_launcher`), meeting at
        node 0's address. Raises ``LaunchError`` when a node fails (the others are killed at
        once) or when ``timeout`` seconds pass.
        """
        spec = self.spec
        commands = []
        for i in range(spec.nodes):
            launcher = node_launcher(spec, i, (self.node_ips[0], _MASTER_PORT), argv, preload)
            # the emulated link's rate and faults: what a choice cached by the ranks is valid for
            link = " ".join(x for x in (spec.link, spec.per_connection_rate, spec.impair) if x)
            node_env = {**(env or {}), "SLIPSTREAM_NODE": str(i), "GLOO_SOCKET_IFNAME": self.iface,
                        "SLIPSTREAM_LINK": link or "unlimited"}
            commands.append((self.node_command(i, launcher), node_env))
        _run_nodes(commands, timeout)

    def measure_throughput(self, *, src: int = 1, dst: int = 0, nbytes: int = 32 << 20,
                           flows: int = 1, port: int = 5201, timeout: float = 60.0) -> float:
        """TCP goodput in bits/s from node ``src`` to node ``dst``: ``nbytes`` over ``flows``
        connections to ports ``port .. port+flows-1``, timed at the receiver."""
        tool = [sys.executable, "-m", "slipstream.cluster._probe"]
        ip = self.node_ips[dst]
        recv = subprocess.Popen(
            self.node_command(dst, [*tool, "recv", ip, str(port), str(flows)]),
            stdout=subprocess.PIPE, text=True,
        )
        try:
            if not _says_ready(recv, timeout):
                raise NetnsError(f"the throughput receiver did not start within {timeout:g} s")
            subprocess.run(self.node_command(src, [*tool, "send", ip, str(port), str(flows),
                                                   str(nbytes)]), check=True, timeout=timeout)
            out, _ = recv.communicate(timeout=timeout)
            return float(out.strip())
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait()


def _says_ready(proc: subprocess.Popen, timeout: float) -> bool:
    """Whether ``proc`` prints ``ready`` as its first line within ``timeout`` seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return bool(ready) and proc.stdout.readline().strip() == "ready"  # type: ignore[union-attr]


def _remove_stale(names: Sequence[str]) -> None:
    """Delete our namespaces whose creating process no longer exists."""
    for name in names:
        m = _NAME.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _netns.del_ns(name)


def launch(argv: Sequence[str], spec: ClusterSpec, *, env: Mapping[str, str] | None = None,
           timeout: float | None = None, preload: Sequence[str] = ()) -> None:
    """Run ``argv`` on ``spec.world_size`` ranks: on an emulated cluster when ``spec.nodes``
    is 2 or more (root needed), else on loopback. ``preload``: modules the ranks will import,
    imported once per node where the ranks are forked (:func:`node_launcher`)."""
    if spec.emulated:
        with EmulatedCluster(spec) as cluster:
            cluster.launch(argv, env=env, timeout=timeout, preload=preload)
        return
    _run_nodes([(node_launcher(spec, 0, None, argv, preload),
                 {"GLOO_SOCKET_IFNAME": "lo", **(env or {}), "SLIPSTREAM_NODE": "0"})], timeout)


def node_launcher(spec: ClusterSpec, node: int, master: tuple[str, int] | None, argv: Sequence[str],
                  preload: Sequence[str] = ()) -> list[str]:
    """The command that starts node ``node``'s ranks (``master`` None: one node on loopback).
    Without an accelerator, ``_forkrun``: the ranks are forked after the node's launcher
    imported what they need once; else (or with ``SLIPSTREAM_LAUNCHER=torchrun``) torch's
    ``torch.distributed.run``, each rank a new interpreter."""
    nodes = [] if master is None else [
        "--nnodes", str(spec.nodes), "--node-rank", str(node), "--master-addr", master[0],
        "--master-port", str(master[1])]
    if _fork_ranks():
        return [sys.executable, "-c", _forkrun.BOOTSTRAP, *nodes, "--nproc-per-node",
                str(spec.ranks_per_node), "--preload", ",".join(preload), *argv]
    return [sys.executable, "-m", "torch.distributed.run", *(nodes or ["--standalone"]), "--nproc-per-node",
            str(spec.ranks_per_node), *argv]


def _fork_ranks() -> bool:
    """Whether the node launchers fork their ranks: ``SLIPSTREAM_LAUNCHER`` (``fork``,
    ``torchrun``, or ``auto``, the default: fork where no accelerator is visible, since a
    process that initialised one cannot hand it to forked children)."""
    choice = os.environ.get("SLIPSTREAM_LAUNCHER", "auto").strip().lower() or "auto"
    if choice not in ("auto", "fork", "torchrun"):
        raise ValueError(f"SLIPSTREAM_LAUNCHER={choice!r}: expected auto, fork or torchrun")
    if choice != "auto":
        return choice == "fork"
    torch = sys.modules.get("torch")
    if torch is not None:
        accelerator = getattr(torch, "accelerator", None)
        return not (torch.cuda.is_available() or (accelerator is not None and accelerator.is_available()))
    return not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd")) and not glob.glob("/dev/accel/*")
