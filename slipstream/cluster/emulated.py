"""An emulated multi-node cluster on one machine: N nodes x M ranks, slow links between nodes.

Each node is a network namespace holding one end of a veth pair (``veth0``, address
``10.213.<c>.<node+1>/24``, ``c`` a third octet free among this machine's clusters); the other
ends sit on a bridge in a "switch" namespace. ``tc`` limits each node's link in both
directions: on the node's egress and on the switch's egress towards the node. Traffic between
ranks of one node goes to the node's own address and stays local (the kernel routes it over
loopback), traffic between nodes crosses two shaped links. Ranks are started by torch's own
launcher, one ``torch.distributed.run`` per node inside its namespace, with
``SLIPSTREAM_NODE=<node>`` (so topology detection, and hence shared memory, follows the emulated
nodes) and ``GLOO_SOCKET_IFNAME=veth0``. With one node nothing is emulated: plain
``torch.distributed.run --standalone`` on loopback, no root needed. Every process runs the
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
unknown"), so there is no delay option either. A connection is capped when one of its ends
uses a port of the range, and capped on its own when no other connection uses that port: a
transport gives every connection its own listening port in the range, or binds its client
sockets there. Automatic (ephemeral) ports start at 32768, so the default range
20000-20063 never catches unrelated traffic.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

from . import _netns
from ._netns import NetnsError

__all__ = ["ClusterSpec", "EmulatedCluster", "LaunchError", "NetnsError", "launch", "parse_rate"]

_UNITS = {"": 1, "bit": 1, "bps": 8}
for _i, _p in enumerate("kmgt", start=1):
    _UNITS.update({f"{_p}bit": 1e3**_i, f"{_p}ibit": 1024**_i,
                   f"{_p}bps": 8 * 1e3**_i, f"{_p}ibps": 8 * 1024**_i})

_NAME = re.compile(r"slipstream-(\d+)-([0-9a-f]+)-(\d+)-(n\d+|sw)$")
_MASTER_PORT = 29500
_SUBNET = "10.213"


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
    def emulated(self) -> bool:
        """Whether nodes are network namespaces (else: one plain local node)."""
        return self.nodes > 1


class LaunchError(RuntimeError):
    """A node's launcher failed or timed out; the message holds its last lines of output."""


# Clusters entered and not yet closed, closed at interpreter exit and on SIGTERM / SIGHUP.
_LIVE: dict[int, "EmulatedCluster"] = {}
_SAVED_HANDLERS: dict[int, object] = {}


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through ``with`` blocks, then atexit


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _unwind_on_termination() -> dict:
    """Make SIGTERM and SIGHUP raise ``SystemExit`` where they would still kill this process
    outright (main thread, default handler), and SIGINT raise ``KeyboardInterrupt`` where it is
    ignored: a job started in the background by a script inherits SIGINT ignored, and a
    ``kill -INT`` would then leave its ranks running to the end (torchrun, too, handles SIGINT
    whatever it inherited). Returns the handlers to put back."""
    saved = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                saved[sig] = signal.signal(sig, _exit_on_signal)
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            saved[signal.SIGINT] = signal.signal(signal.SIGINT, _interrupt)
    return saved


def _restore_handlers(saved: dict) -> None:
    for sig, handler in saved.items():
        signal.signal(sig, handler)


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

    __slots__ = ("spec", "_tag", "_octet", "_made")

    def __init__(self, spec: ClusterSpec) -> None:
        if not spec.emulated:
            raise ValueError("an emulated cluster needs nodes >= 2; launch() runs one node locally")
        self.spec = spec
        self._tag: str | None = None  # name prefix, chosen on enter
        self._octet = 0  # third octet of this cluster's addresses
        self._made: list[str] = []  # namespaces created, in order

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

    def close(self) -> None:
        """Kill what runs in our namespaces and delete them; idempotent."""
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
            run("ip", "link", "set", port, "master", "br0", "up", ns=sw)
            run("ip", "addr", "add", f"{ip}/24", "dev", self.iface, ns=ns)
            run("ip", "link", "set", self.iface, "up", ns=ns)
            if spec.link is not None:  # both directions: the node's egress and the switch's towards it
                per_conn = None if spec.per_connection_rate is None else parse_rate(spec.per_connection_rate)
                for where, dev in ((ns, self.iface), (sw, port)):
                    _netns.shape_egress(where, dev, parse_rate(spec.link), per_connection_bps=per_conn,
                                        capped_ports=spec.capped_ports)

    def node_command(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``node``'s namespace (on its CPUs with ``pin_nodes``)."""
        if self.spec.pin_nodes:
            cpus = sorted(os.sched_getaffinity(0))
            share = max(1, len(cpus) // self.spec.nodes)
            mine = [cpus[(node * share + k) % len(cpus)] for k in range(share)]
            argv = ["taskset", "-c", ",".join(map(str, mine)), *argv]
        return ["ip", "netns", "exec", self.namespaces[node], *argv]

    def launch(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
               timeout: float | None = None) -> None:
        """Run ``argv`` (a script and its arguments, or ``-m module ...``) on every rank.

        One ``torch.distributed.run`` per node inside its namespace, meeting at node 0's
        address. Raises ``LaunchError`` when a node fails (the others are killed at once) or
        when ``timeout`` seconds pass.
        """
        spec = self.spec
        commands = []
        for i in range(spec.nodes):
            torchrun = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", str(spec.nodes),
                "--node-rank", str(i), "--nproc-per-node", str(spec.ranks_per_node),
                "--master-addr", self.node_ips[0], "--master-port", str(_MASTER_PORT), *argv,
            ]
            node_env = {**(env or {}), "SLIPSTREAM_NODE": str(i), "GLOO_SOCKET_IFNAME": self.iface}
            commands.append((self.node_command(i, torchrun), node_env))
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
            if recv.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                raise NetnsError("the throughput receiver did not start")
            subprocess.run(self.node_command(src, [*tool, "send", ip, str(port), str(flows),
                                                   str(nbytes)]), check=True, timeout=timeout)
            out, _ = recv.communicate(timeout=timeout)
            return float(out.strip())
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait()


def _remove_stale(names: Sequence[str]) -> None:
    """Delete our namespaces whose creating process no longer exists."""
    for name in names:
        m = _NAME.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _netns.del_ns(name)


def launch(argv: Sequence[str], spec: ClusterSpec, *, env: Mapping[str, str] | None = None,
           timeout: float | None = None) -> None:
    """Run ``argv`` on ``spec.world_size`` ranks: on an emulated cluster when ``spec.nodes``
    is 2 or more (root needed), else with plain ``torch.distributed.run`` on loopback."""
    if spec.emulated:
        with EmulatedCluster(spec) as cluster:
            cluster.launch(argv, env=env, timeout=timeout)
        return
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(spec.ranks_per_node), *argv]
    _run_nodes([(torchrun, {"GLOO_SOCKET_IFNAME": "lo", **(env or {}), "SLIPSTREAM_NODE": "0"})],
               timeout)


def _stream(proc: subprocess.Popen, prefix: str, tail: deque) -> None:
    for line in proc.stdout:  # type: ignore[union-attr]
        tail.append(line)
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


def _run_nodes(commands: Sequence[tuple[list[str], Mapping[str, str]]], timeout: float | None) -> None:
    """Start one launcher per node, stream their output, fail fast on the first failure.
    SIGINT, SIGTERM and SIGHUP stop every rank (SIGTERM, then SIGKILL after 5 s) before this
    returns: while the ranks run, SIGTERM and SIGHUP (a scheduler stopping the job) unwind like
    Ctrl-C into the cleanup (the launchers run in sessions of their own, which a signal to this
    process does not reach)."""
    saved = _unwind_on_termination()
    try:
        _run_and_reap(commands, timeout)
    finally:
        _restore_handlers(saved)


def _run_and_reap(commands: Sequence[tuple[list[str], Mapping[str, str]]], timeout: float | None) -> None:
    procs, tails, readers = [], [], []
    ranks: set[int] = set()  # every process seen below the launchers: whose build locks to clear
    deadline = None if timeout is None else time.monotonic() + timeout
    succeeded = False
    try:
        for i, (argv, env) in enumerate(commands):
            proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace",
                                    start_new_session=True)
            procs.append(proc)
            tails.append(deque(maxlen=40))
            prefix = f"[node {i}] " if len(commands) > 1 else ""
            readers.append(threading.Thread(target=_stream, args=(proc, prefix, tails[-1]), daemon=True))
            readers[-1].start()
        next_look = 0.0
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                report = _tails(tails, range(len(procs)))  # before the kill adds its noise
                raise LaunchError(f"launch timed out after {timeout} s; killed every node\n{report}")
            if time.monotonic() > next_look:  # a rank that dies early still held its pid here
                ranks.update(p for proc in procs for p in _netns.descendants(proc.pid))
                next_look = time.monotonic() + 1.0
            time.sleep(0.05)
        if failed:
            for i in failed:
                readers[i].join(timeout=5)
            nodes = ", ".join(f"node {i} (exit code {codes[i]})" for i in failed)
            raise LaunchError(f"{nodes} failed; killed the other nodes\n" + _tails(tails, failed))
        succeeded = True
    finally:
        ranks.update(_netns.kill_process_trees(procs))
        for r in readers:
            r.join(timeout=5)
        if not succeeded:  # ranks that exit 0 released their locks
            _clear_build_locks(ranks, [{**os.environ, **env} for _, env in commands])


def _clear_build_locks(ranks: set[int], environs: Sequence[Mapping[str, str]]) -> None:
    """Remove the torch extension build locks our stopped ranks held (one killed while it
    built or checked DeepSpeed's op): the next job would meet them."""
    from ..plugins.deepspeed.build_lock import remove_locks_of

    try:
        for path in remove_locks_of(ranks, environs):
            sys.stderr.write(f"slipstream: removed the build lock {path} of a stopped rank\n")
    except (OSError, ImportError) as e:  # never hide why the job stopped
        sys.stderr.write(f"slipstream: could not look for the stopped ranks' build locks: {e}\n")


def _tails(tails: Sequence[deque], nodes: Sequence[int]) -> str:
    return "\n".join(f"--- last lines of node {i} ---\n{''.join(tails[i])}" for i in nodes)
