"""Raw ``ip`` / ``tc`` commands behind the emulated cluster (``emulated.py``).

Every function names the namespace it acts in. Nothing here touches the caller's own network
namespace except creating and deleting the named namespaces themselves: veth pairs are made with
both ends directly inside their namespaces, so no interface ever appears on the host.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

__all__ = ["NetnsError", "missing_privileges", "run", "add_ns", "del_ns", "kill_process_trees", "list_ns", "add_veth",
           "shape_egress"]

# tbf bucket: at least one 64 KiB GSO segment (tbf segments anything larger than the bucket in
# software, so big segments neither blow through nor stall it), and a queue of 40 ms at the
# rate so that TCP's 4 MiB of unacknowledged data per socket (tcp_limit_output_bytes) does not
# overflow it. Measured on 2 nodes through a bridge, one TCP flow of 32 MiB (goodput, so 1448
# payload bytes per 1514-byte frame: 95.6% of the rate at best):
#   1gbit: 64 KiB -> 958.8 Mbit/s, 1 MiB -> 971 (the bucket's initial burst shows); 0 drops
#   100mbit: 64 KiB -> 95.8 Mbit/s; a 5 ms queue dropped 1323 packets, 40 ms none.
_MIN_BURST_BYTES = 64 * 1024
_BURST_SECONDS = 250e-6
_QUEUE_SECONDS = 40e-3
COMMAND_TIMEOUT_S = 60.0  # an ip/tc command takes milliseconds; a minute means it hangs


class NetnsError(RuntimeError):
    """An ``ip`` or ``tc`` command failed, or the machine cannot run them."""


def missing_privileges() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root to create network namespaces (run as root)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the emulated cluster needs iproute2 ({', '.join(missing)} not found; apt-get install iproute2)"
    return None


def run(*argv: str, ns: str | None = None, stdin: str | None = None, check: bool = True) -> str:
    """Run ``ip``/``tc`` (``argv[0]``) inside namespace ``ns``; return stdout.

    ``ip -n`` and ``tc -n`` enter the namespace themselves, so no process is left in it.
    """
    cmd = [argv[0], *(("-n", ns) if ns else ()), *argv[1:]]
    try:
        proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{' '.join(cmd)}` did not finish within {COMMAND_TIMEOUT_S:g} s (killed)") from None
    if check and proc.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def add_ns(name: str) -> None:
    run("ip", "netns", "add", name)
    run("ip", "link", "set", "lo", "up", ns=name)


def list_ns() -> list[str]:
    """Names of all named network namespaces on the machine."""
    out = run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def ns_pids(name: str) -> list[int]:
    out = run("ip", "netns", "pids", name, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def del_ns(name: str) -> None:
    """Kill what still runs in namespace ``name`` (we started all of it), then delete it.

    Its interfaces go with it, and with them their veth peers in other namespaces.
    """
    for pid in ns_pids(name):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    run("ip", "netns", "del", name, check=False)


def descendants(pid: int) -> list[int]:
    """Processes below ``pid`` (torchrun starts each worker in a session of its own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def kill_process_trees(procs: Sequence[subprocess.Popen]) -> list[int]:
    """SIGTERM each launcher and every process below it, SIGKILL what is left after 5 s.
    Returns the pids signalled."""
    pids = [p for proc in procs if proc.poll() is None for p in (proc.pid, *descendants(proc.pid))]
    signalled = list(pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            for proc in procs:
                proc.poll()  # reap our own children so that they stop counting as alive
            pids = [p for p in pids if _alive(p)]
            if not pids:
                break
            time.sleep(0.05)
    for proc in procs:
        proc.wait()
    return signalled


def add_veth(ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
    """A veth pair with end ``dev_a`` in ``ns_a`` and ``dev_b`` in ``ns_b``."""
    run("ip", "link", "add", "name", dev_a, "netns", ns_a, "type", "veth",
        "peer", "name", dev_b, "netns", ns_b)


def _bucket(rate_bps: float) -> tuple[int, int]:
    """(burst, limit) in bytes for a tbf/htb at ``rate_bps``."""
    burst = max(_MIN_BURST_BYTES, int(rate_bps / 8 * _BURST_SECONDS))
    return burst, burst + int(rate_bps / 8 * _QUEUE_SECONDS)


def shape_egress(ns: str, dev: str, rate_bps: float, *, per_connection_bps: float | None = None,
                 capped_ports: range = range(0)) -> None:
    """Limit what leaves ``dev`` in ``ns`` to ``rate_bps``.

    Without a per-connection rate: one tbf. With one: an htb whose root class holds the link
    rate; each port of ``capped_ports`` gets a class capped (ceil) at ``per_connection_bps``,
    chosen by u32 filters on the TCP/UDP source or destination port; other traffic goes to a
    default class that may use the whole link. Every class is guaranteed only an equal share
    of the link (``rate``), so guaranteed rates never add up past the link and the root's
    ceil really caps the total.
    """
    burst, limit = _bucket(rate_bps)
    if per_connection_bps is None:
        run("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(rate_bps)}bit",
            "burst", str(burst), "limit", str(limit), ns=ns)
        return
    share = f"{max(int(rate_bps / (len(capped_ports) + 1)), 8000)}bit"
    link, cap = f"{int(rate_bps)}bit", f"{int(per_connection_bps)}bit"
    common = f"burst {burst} cburst {burst} quantum 65536"
    lines = [
        f"qdisc replace dev {dev} root handle 1: htb default 2",
        f"class add dev {dev} parent 1: classid 1:1 htb rate {link} ceil {link} {common}",
        f"class add dev {dev} parent 1:1 classid 1:2 htb rate {share} ceil {link} {common}",
    ]
    for k, port in enumerate(capped_ports):
        cls = f"1:{0x100 + k:x}"
        lines.append(f"class add dev {dev} parent 1:1 classid {cls} htb rate {share} ceil {cap} {common}")
        lines += [f"filter add dev {dev} parent 1: protocol ip prio 1 u32 match ip {field} {port} 0xffff flowid {cls}"
                  for field in ("dport", "sport")]
    run("tc", "-batch", "-", ns=ns, stdin="\n".join(lines) + "\n")
