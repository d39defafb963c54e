"""The TCP layer of ``tcp.py``: connection set-up (ports, greeting), the wire header, and
the lanes (per connection, a sending thread and a receiving thread) that run the steps
``MultiConnInter`` hands them. See ``tcp.py``'s docstring for the design.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import secrets
import socket
import struct
import threading
import time
from concurrent.futures import Future
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..ops import DTYPES, KINDS, code, name_of
from ..work import Work

log = logging.getLogger("slipstream.transport")

_MAGIC = b"SLPT"
_HEADER = struct.Struct("<4sBBHQQQ")  # magic, kind, dtype, step, call, numel, piece bytes
_HELLO = struct.Struct("<4s16sII")  # magic, set-up token, group rank, lane
# How long an accepted connection may take to greet before it is dropped as foreign.
_GREETING_S = 5.0
# The socket timeout bounds each sendall; slicing makes it bound a stall, not a whole message.
_SEND_SLICE = 4 << 20


class TransportError(RuntimeError):
    """A peer died, stalled past ``timeout_s``, or called a different collective."""


class _Call:
    """One collective in flight: its header fields and the lanes still running it."""

    __slots__ = ("seq", "kind", "dtype", "numel", "future", "_left", "_lock")

    def __init__(self, seq: int, kind: int, dtype: int, numel: int, lanes: int) -> None:
        self.seq, self.kind, self.dtype, self.numel = seq, kind, dtype, numel
        self.future: Future = Future()
        self._left = lanes
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"{name_of(KINDS, self.kind)} #{self.seq} of {self.numel} {name_of(DTYPES, self.dtype)}"

    def lane_done(self, error: BaseException | None) -> None:
        with self._lock:
            self._left -= 1
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            elif self._left == 0:
                self.future.set_result(None)


# A lane's share of one step: send a piece, receive one, then run ``post`` (reduce, copy).
_Step = tuple[torch.Tensor, torch.Tensor, Callable[[], object] | None]


class _Lanes:
    """The sockets and threads: per lane, the connection(s) and two threads. Owns no tensors
    beyond the calls in flight; closed by ``close()`` or at exit (``weakref.finalize``)."""

    __slots__ = ("send_socks", "recv_socks", "listeners", "peers", "timeout_s", "error", "closed",
                 "_pid", "_lock", "_seq", "_work", "_recvs", "_threads")

    def __init__(self, send_socks, recv_socks, listeners, peers: tuple[str, str], timeout_s: float) -> None:
        self.send_socks: list[socket.socket] = send_socks
        self.recv_socks: list[socket.socket] = recv_socks
        self.listeners: list[socket.socket] = listeners
        self.peers = peers  # (right, left): whom we send to, whom we receive from
        self.timeout_s = timeout_s
        self.error: BaseException | None = None  # the first failure; breaks the transport
        self.closed = False
        self._pid = os.getpid()  # a forked child (a DataLoader worker) must not shut our sockets
        self._lock = threading.Lock()
        self._seq = 0
        self._work = [queue.SimpleQueue() for _ in send_socks]
        self._recvs = [queue.SimpleQueue() for _ in send_socks]
        self._threads = []
        for c in range(len(send_socks)):
            for name, target in (("lane", self._lane), ("recv", self._receiver)):
                t = threading.Thread(target=target, args=(c,), name=f"slipstream-{name}-{c}", daemon=True)
                t.start()
                self._threads.append(t)

    def submit(self, kind: str, tensor: torch.Tensor, programs: Sequence[list[_Step]]) -> Work:
        with self._lock:
            if self.error is not None or self.closed:
                raise TransportError(f"the transport is unusable: {self.error or 'it was closed'}")
            call = _Call(self._seq, code(KINDS, kind), code(DTYPES, tensor.dtype), tensor.numel(), len(programs))
            self._seq += 1
            for c, steps in enumerate(programs):
                self._work[c].put((call, steps))
        return Work(call.future)

    def fail(self, error: BaseException) -> None:
        """Record the first error and shut every socket, so that blocked lanes wake up."""
        with self._lock:
            if self.error is None:
                self.error = error
        for s in {*self.send_socks, *self.recv_socks}:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        if self.closed:
            return
        if os.getpid() == self._pid:  # in a forked child, shutdown() would cut the parent's connections too
            with self._lock:
                self.closed = True
            self.fail(TransportError("the transport was closed"))
            for q in (*self._work, *self._recvs):
                q.put(None)
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join(timeout=5)
        self.closed = True
        for s in {*self.send_socks, *self.recv_socks, *self.listeners}:
            s.close()

    def _lane(self, c: int) -> None:
        while (task := self._work[c].get()) is not None:
            call, steps = task
            try:
                for i, (send, recv, post) in enumerate(steps):
                    if self.error is not None:
                        raise self.error
                    view, sock, done = _bytes(send), self.send_socks[c], threading.Event()
                    # The header goes out before this step's receive may start: a receiver that
                    # finds a mismatch and shuts the sockets has sent the peer its header first.
                    sock.sendall(_HEADER.pack(_MAGIC, call.kind, call.dtype, i, call.seq, call.numel, view.nbytes))
                    job = [call, i, recv, done, None]
                    self._recvs[c].put(job)
                    for lo in range(0, view.nbytes, _SEND_SLICE):
                        sock.sendall(view[lo:lo + _SEND_SLICE])
                    done.wait()
                    if job[4] is not None:
                        raise job[4]
                    if post is not None:
                        post()
            except BaseException as e:  # noqa: BLE001 - reported through the call's handle
                self.fail(self._explain(e, c, call, "sending to", self.peers[0]))
                call.lane_done(self.error)
            else:
                call.lane_done(None)

    def _receiver(self, c: int) -> None:
        header = bytearray(_HEADER.size)
        while (job := self._recvs[c].get()) is not None:
            call, step, piece, done = job[:4]
            try:
                if self.error is not None:
                    raise self.error
                view = _bytes(piece)
                _recv_exact(self.recv_socks[c], memoryview(header))
                magic, *got = _HEADER.unpack(header)
                want = [call.kind, call.dtype, step, call.seq, call.numel, view.nbytes]
                if magic != _MAGIC or got != want:
                    raise TransportError(self._mismatch(magic, got, call))
                _recv_exact(self.recv_socks[c], view)
            except BaseException as e:  # noqa: BLE001 - handed to the lane that waits
                job[4] = self._explain(e, c, call, "receiving from", self.peers[1])
                self.fail(job[4])
            done.set()

    def _explain(self, e: BaseException, c: int, call: _Call, doing: str, peer: str) -> BaseException:
        if self.error is not None:
            return self.error  # a consequence of the first failure: report that one
        if isinstance(e, TransportError):
            return e
        where = f"{doing} {peer} on connection {c} during {call.describe()}"
        if isinstance(e, (socket.timeout, TimeoutError)):
            return TransportError(f"no progress {where} for {self.timeout_s:g} s (timeout_s): the peer "
                                  "has died, hangs, is cut off (the link to it is down), or has not called the "
                                  "same collective")
        if isinstance(e, (EOFError, ConnectionError)):
            return TransportError(f"connection lost {where} ({e or 'closed by the peer'}): "
                                  "the peer process has probably exited or failed")
        return TransportError(f"error {where}: {e!r}")

    def _mismatch(self, magic: bytes, got: list, call: _Call) -> str:
        peer = self.peers[1]
        if magic != _MAGIC:
            return f"{peer} sent bytes that are not a slipstream header during {call.describe()}"
        kind, dtype, _, seq, numel, _ = got
        theirs = f"{name_of(KINDS, kind)} #{seq} of {numel} {name_of(DTYPES, dtype)}"
        return (f"collective mismatch with {peer}: it called {theirs}, this rank called "
                f"{call.describe()}; every peer must call the same collectives in the same order "
                "with the same sizes and dtypes")


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, no copy (numpy has no bfloat16: view as uint8)."""
    return memoryview(t.detach().view(torch.uint8).numpy())


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise EOFError("closed by the peer")
        view = view[n:]


def _connect(group, rank: int, size: int, k: int, timeout_s: float, address: str,
             ports: range | None) -> _Lanes:
    """K connections to each ring neighbour; collective over ``group``. With 2 peers, rank 0
    listens and rank 1 connects, and each connection carries both directions; with more,
    every rank listens for its left neighbour and connects to its right one."""
    listens, connects = size > 2 or rank == 0, size > 2 or rank == 1
    listeners = _listen(address, ports, k, timeout_s) if listens else []
    token = secrets.token_bytes(16)
    every: list = [None] * size
    dist.all_gather_object(every, (address, [s.getsockname()[1] for s in listeners], token), group=group)
    right, left = (rank + 1) % size, (rank - 1) % size
    opened: list[socket.socket] = []
    try:
        if connects:
            addr, their_ports, their_token = every[right]
            for c, port in enumerate(their_ports):
                opened.append(socket.create_connection((addr, port), timeout=timeout_s))
                opened[-1].sendall(_HELLO.pack(_MAGIC, their_token, rank, c))
        for c, listener in enumerate(listeners):
            opened.append(_accept(listener, left, c, token, timeout_s))
    except BaseException:
        for s in (*opened, *listeners):
            s.close()
        raise
    for s in opened:
        s.settimeout(timeout_s)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out, inc = (opened[:k], opened[k:]) if connects else ([], opened)
    peers = tuple(f"global rank {dist.get_global_rank(group, r)} ({every[r][0]})" for r in (right, left))
    # The listeners stay open while the transport lives, so that its ports stay its own.
    return _Lanes(out or inc, inc or out, listeners, peers, timeout_s)


def _listen(address: str, ports: range | None, k: int, timeout_s: float) -> list[socket.socket]:
    """K listening sockets. With ``ports``, global rank g takes the first block of K free ports
    at ``ports[(j*W + g)*K:]``, j = 0, 1, ... (W the world size): blocks of different ranks
    never overlap, so every connection of the job has a port of its own, and a second
    transport of the same process moves on to its next block."""
    if ports is None:
        return _bind_all(address, [0] * k, timeout_s)
    g, world, busy = dist.get_rank(), dist.get_world_size(), None
    for start in range(g * k, len(ports) - k + 1, world * k):
        try:
            return _bind_all(address, ports[start:start + k], timeout_s)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise TransportError(f"cannot listen on {address}: {e}") from None
            busy = e
    raise TransportError(f"no {k} free ports for global rank {g} in {ports} (blocks of {k} from index "
                         f"{g * k}, every {world * k}): {busy or 'the range is too short'}")


def _bind_all(address: str, ports: Sequence[int], timeout_s: float) -> list[socket.socket]:
    listeners: list[socket.socket] = []
    try:
        for port in ports:  # SO_REUSEADDR set; a backlog of 8: room for a peer behind a foreign connection
            listeners.append(socket.create_server((address, port), backlog=8))
            listeners[-1].settimeout(timeout_s)
    except BaseException:
        for sock in listeners:
            sock.close()
        raise
    return listeners


def _accept(listener: socket.socket, peer: int, c: int, token: bytes, timeout_s: float) -> socket.socket:
    """The connection of group rank ``peer``'s lane ``c``, within ``timeout_s``. A connection
    that does not greet as that peer of this set-up (a port scanner, a stale job, anything
    without the token) is closed and the wait goes on: it cannot make the set-up fail."""
    where = f"{':'.join(map(str, listener.getsockname()))} (connection {c})"
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        listener.settimeout(left)
        try:
            conn, source = listener.accept()
        except socket.timeout:
            break
        conn.settimeout(min(left, _GREETING_S))
        hello = bytearray(_HELLO.size)
        try:
            _recv_exact(conn, memoryview(hello))
        except (OSError, EOFError) as e:
            conn.close()
            log.warning("slipstream: ignored a connection from %s to %s: no greeting (%s)", source, where, e)
            continue
        if _HELLO.unpack(hello) != (_MAGIC, token, peer, c):
            conn.close()
            log.warning("slipstream: ignored a connection from %s to %s: not group rank %d of this set-up",
                        source, where, peer)
            continue
        conn.settimeout(timeout_s)
        return conn
    raise TransportError(f"group rank {peer} did not connect to {where} within {timeout_s:g} s")
