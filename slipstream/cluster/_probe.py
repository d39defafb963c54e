"""The two ends of ``EmulatedCluster.measure_throughput``, run inside node namespaces.

``python -m slipstream.cluster._probe recv <ip> <port> <flows>`` prints ``ready``, then the
bits/s it received; ``... send <ip> <port> <flows> <nbytes>`` sends. A module of its own
because the package imports ``_netns`` and ``emulated``: ``-m`` on either would run a second
copy of it.
"""

from __future__ import annotations

import socket
import sys
import threading
import time


def _receive(ip: str, port: int, flows: int) -> None:
    """Accept one connection on each of ``port .. port+flows-1``; print bits/s received.

    Time runs from the first byte to the last, so connection set-up is not counted.
    """
    listeners = []
    for k in range(flows):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((ip, port + k))
        s.listen(1)
        listeners.append(s)
    print("ready", flush=True)
    spans: list[tuple[float, float, int]] = []

    def drain(listener: socket.socket) -> None:
        conn, _ = listener.accept()
        first, total = None, 0
        while chunk := conn.recv(1 << 20):
            first = first or time.perf_counter()
            total += len(chunk)
        spans.append((first or time.perf_counter(), time.perf_counter(), total))

    threads = [threading.Thread(target=drain, args=(s,)) for s in listeners]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start, end = min(s[0] for s in spans), max(s[1] for s in spans)
    print(sum(s[2] for s in spans) * 8 / max(end - start, 1e-9), flush=True)


def _send(ip: str, port: int, flows: int, nbytes: int) -> None:
    """Send ``nbytes`` in all, split over ``flows`` connections to ``port .. port+flows-1``."""
    block = b"\0" * (1 << 20)

    def push(k: int) -> None:
        with socket.create_connection((ip, port + k), timeout=60) as s:
            left = nbytes // flows
            while left > 0:
                left -= s.send(block[: min(left, len(block))])

    threads = [threading.Thread(target=push, args=(k,)) for k in range(flows)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    mode, args = sys.argv[1], [int(a) if a.isdigit() else a for a in sys.argv[2:]]
    (_receive if mode == "recv" else _send)(*args)
