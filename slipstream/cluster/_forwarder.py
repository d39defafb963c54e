"""The forwarder behind an impaired link (``_impair.Impairment``), run in the switch namespace.

With an impairment, each node's switch port sits on a bridge of its own with the node side of a
tap pair; the core side sits on the core bridge. ``python -m slipstream.cluster._forwarder``
creates the taps, prints ``ready``, and copies Ethernet frames between the two sides of every
pair. Frames a node sends (its egress) are dropped, delayed or reordered, once on their way to
any other node, as netem on every node's interface would; frames towards a node pass as they
are. ARP crosses the same path. A module of its own for ``-m`` (see ``_probe.py``).

The loop is Python: it adds its own cost per frame (one TCP flow through it with no impairment:
427 Mbit/s on the 2-core KVM guest with another job running, against 901 Mbit/s on the clean
1 Gbit/s link), so it serves fault cases, not rate figures.
It exits when the process that started it is gone, and it dies with the switch namespace.
"""

from __future__ import annotations

import fcntl
import heapq
import json
import os
import random
import select
import struct
import sys
import time
from pathlib import Path

from .._common.cache import write_json
from ._impair import Impairment, tap_names

_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI = 0x0002, 0x1000
_FRAME = 65536  # read size: a tap without offloads hands over one frame of at most the MTU
_QUEUE_LIMIT = 20000  # frames held at once; more are dropped, as a full netem queue drops
_STATS_EVERY_S = 0.5


def _open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    return fd


class _Forwarder:
    """Frames in from every tap, out of its pair's other side; delayed ones held in a heap."""

    __slots__ = ("impair", "rng", "peer", "impaired", "held", "seq", "stats")

    def __init__(self, nodes: int, impair: Impairment) -> None:
        self.impair, self.rng = impair, random.Random(impair.seed)
        self.peer: dict[int, int] = {}  # fd -> the fd its frames go out of
        self.impaired: set[int] = set()  # node sides: frames a node sent
        for node in range(nodes):
            core, node_side = (_open_tap(name) for name in tap_names(node))
            self.peer[core], self.peer[node_side] = node_side, core
            self.impaired.add(node_side)
        self.held: list[tuple[float, int, int, bytes]] = []  # (due, seq, out fd, frame)
        self.seq = 0
        self.stats = {"frames": 0, "dropped": 0, "delayed": 0, "ahead": 0, "overflowed": 0, "max_held": 0}

    def take(self, fd: int, frame: bytes, now: float) -> None:
        out = self.peer[fd]
        if fd not in self.impaired:
            os.write(out, frame)
            return
        self.stats["frames"] += 1
        delay = self.impair.delay_of(self.rng)
        if delay is None:
            self.stats["dropped"] += 1
            return
        if delay == 0.0 and self.impair.reorder:  # sent ahead of the frames held (netem's reorder)
            self.stats["ahead"] += 1
        if delay == 0.0 and not self.held:
            os.write(out, frame)
        elif len(self.held) >= _QUEUE_LIMIT:
            self.stats["overflowed"] += 1
        else:
            self.stats["delayed"] += delay > 0.0
            self._hold(now + delay, out, frame)

    def _hold(self, due: float, out: int, frame: bytes) -> None:
        self.seq += 1
        heapq.heappush(self.held, (due, self.seq, out, frame))
        self.stats["max_held"] = max(self.stats["max_held"], len(self.held))

    def release(self, now: float) -> float:
        """Send what is due; seconds until the next frame is (1 s when none is held)."""
        while self.held and self.held[0][0] <= now:
            _, _, out, frame = heapq.heappop(self.held)
            try:
                os.write(out, frame)
            except OSError:  # the port is down (a cut link): the frame is lost, as on a wire
                pass
        return self.held[0][0] - now if self.held else 1.0

    def run(self, stats_path: str | None) -> None:
        poller = select.poll()
        for fd in self.peer:
            poller.register(fd, select.POLLIN)
        parent, next_stats = os.getppid(), 0.0
        while os.getppid() == parent:
            now = time.monotonic()
            wait = self.release(now)
            if stats_path:  # idle, the counters are still written on time
                wait = min(wait, next_stats - now)
            for fd, _ in poller.poll(max(0.0, min(wait, 1.0)) * 1e3):
                for _ in range(256):  # drain a burst, then let due frames out
                    try:
                        frame = os.read(fd, _FRAME)
                    except OSError:  # nothing more to read (EAGAIN)
                        break
                    try:
                        self.take(fd, frame, time.monotonic())
                    except OSError:  # the pair's other side is down (a cut link)
                        pass
            if stats_path and time.monotonic() > next_stats:
                write_json(Path(stats_path), self.stats)
                next_stats = time.monotonic() + _STATS_EVERY_S


def main(argv: list[str]) -> int:
    """``_forwarder NODES IMPAIRMENT_JSON [STATS_PATH]``: create the taps, say ``ready``, forward."""
    forwarder = _Forwarder(int(argv[0]), Impairment(**json.loads(argv[1])))
    print("ready", flush=True)
    forwarder.run(argv[2] if len(argv) > 2 else None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
