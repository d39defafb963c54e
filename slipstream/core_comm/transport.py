"""Multi-connection inter-node transport: every message split across K TCP connections.

Clouds cap a single TCP flow below the link rate, and one connection driven by one thread
rarely fills a fast link. ``MultiConnInter`` is an ``InterTransport`` (``hierarchical.py``)
that keeps K connections to each ring neighbour and cuts every block of a message into K
pieces, piece ``c`` travelling on connection ``c``.

Algorithms among N peers (S bytes per rank):

    all_reduce, N = 2   one direct exchange: each sends its whole tensor and reduces what
                        arrives (S out of each node, the least possible, in one round trip)
    all_reduce, N > 2   ring reduce-scatter, then ring allgather (2(N-1)/N x S out of each node)
    reduce_scatter      ring, N-1 steps;  all_gather: ring, N-1 steps

Lanes: lane ``c`` is a thread that runs piece ``c`` of every call, in call order, step by
step: send the header, post the receive, send the piece, wait for the receive, reduce (torch
ops and socket I/O release the GIL, so lanes and the caller's thread run in parallel). A receiver thread per lane reads its
connection with ``recv_into`` straight into the tensor's memory. Calls return a handle at once;
one call's pieces are queued on every lane under one lock, so calls keep their order.

Wire: before every piece (empty ones too) a 32-byte header names the call number, kind, dtype,
element count and piece size; the receiver checks them, so a size or order mismatch between
peers raises instead of corrupting data. Any error (a dead peer, a timeout, a mismatch) breaks
the transport: every pending and later call raises that first error.

Ports: each rank listens on K ports of its own for the transport's life (``_listen``), so
that per-connection rate limits keyed on ports (the emulated cluster's) see one flow per port.
"""

from __future__ import annotations

import errno
import fcntl
import os
import queue
import secrets
import socket
import struct
import threading
import weakref
from concurrent.futures import Future
from functools import partial
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["MultiConnInter", "TransportError", "endpoint_from_env"]

ReduceOp = dist.ReduceOp
_REDUCE = {ReduceOp.SUM: torch.add, ReduceOp.PRODUCT: torch.mul,
           ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum}
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
           torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_KINDS = ("all_reduce", "reduce_scatter", "all_gather")
_MAGIC = b"SLPT"
_HEADER = struct.Struct("<4sBBHQQQ")  # magic, kind, dtype, step, call, numel, piece bytes
_HELLO = struct.Struct("<4s16sII")  # magic, set-up token, group rank, lane
# The socket timeout bounds each sendall; slicing makes it bound a stall, not a whole message.
_SEND_SLICE = 4 << 20
_SIOCGIFADDR = 0x8915
# Lanes per step: at most one per 64 KiB. Handing a piece to a lane thread costs more than a
# small piece gains: splitting over all 4 lanes ran a 16 KiB allreduce at 0.38x the speed of
# K=1 and a 64 KiB one at 0.86x, a 256 KiB one at 3.2x (2 emulated nodes, 1gbit link,
# 250mbit per connection; benchmarks/results/transport_xeon-2core-kvm_2026-11-21.md).
_MIN_PIECE = 64 << 10


class TransportError(RuntimeError):
    """A peer died, stalled past ``timeout_s``, or called a different collective."""


def endpoint_from_env(environ: Mapping[str, str] = os.environ) -> tuple[str, range | None]:
    """``(address, ports)`` to listen on: the IPv4 address of ``GLOO_SOCKET_IFNAME``'s (first)
    interface, else the host name's; ports from ``SLIPSTREAM_PORT_BASE`` up, else None
    (ports the kernel picks)."""
    ifname = environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname[:15].encode()))
            except OSError as e:
                raise TransportError(f"GLOO_SOCKET_IFNAME={ifname!r}: no IPv4 address ({e})") from None
        address = socket.inet_ntoa(raw[20:24])
    else:
        address = socket.gethostbyname(socket.gethostname())
    base = environ.get("SLIPSTREAM_PORT_BASE")
    if base is None:
        return address, None
    if not base.isdigit() or not 1 <= int(base) < 65536:
        raise ValueError(f"SLIPSTREAM_PORT_BASE={base!r}: expected a port number 1-65535")
    return address, range(int(base), 65536)


class _Call:
    """One collective in flight: its header fields and the lanes still running it."""

    __slots__ = ("seq", "kind", "dtype", "numel", "future", "_left", "_lock")

    def __init__(self, seq: int, kind: int, dtype: int, numel: int, lanes: int) -> None:
        self.seq, self.kind, self.dtype, self.numel = seq, kind, dtype, numel
        self.future: Future = Future()
        self._left = lanes
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"{_KINDS[self.kind]} #{self.seq} of {self.numel} {_DTYPES[self.dtype]}"

    def lane_done(self, error: BaseException | None) -> None:
        with self._lock:
            self._left -= 1
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            elif self._left == 0:
                self.future.set_result(None)


class _Work:
    """Handle of an asynchronous call, like torch.distributed's ``Work``."""

    __slots__ = ("_future",)

    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self, timeout=None) -> bool:
        self._future.result()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> Future:
        return self._future


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

    def submit(self, kind: str, tensor: torch.Tensor, programs: Sequence[list[_Step]]) -> _Work:
        with self._lock:
            if self.error is not None or self.closed:
                raise TransportError(f"the transport is unusable: {self.error or 'it was closed'}")
            call = _Call(self._seq, _KINDS.index(kind), _DTYPES.index(tensor.dtype), tensor.numel(),
                         len(programs))
            self._seq += 1
            for c, steps in enumerate(programs):
                self._work[c].put((call, steps))
        return _Work(call.future)

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
        if os.getpid() != self._pid:  # shutdown() would cut the parent's connections too
            self.closed = True
            for s in {*self.send_socks, *self.recv_socks, *self.listeners}:
                s.close()
            return
        with self._lock:
            self.closed = True
        self.fail(TransportError("the transport was closed"))
        for q in (*self._work, *self._recvs):
            q.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        for s in {*self.send_socks, *self.recv_socks, *self.listeners}:
            s.close()

    # ------------------------------------------------------------ threads

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

    # ------------------------------------------------------------ messages

    def _explain(self, e: BaseException, c: int, call: _Call, doing: str, peer: str) -> BaseException:
        if self.error is not None:
            return self.error  # a consequence of the first failure: report that one
        if isinstance(e, TransportError):
            return e
        where = f"{doing} {peer} on connection {c} during {call.describe()}"
        if isinstance(e, (socket.timeout, TimeoutError)):
            return TransportError(f"no progress {where} for {self.timeout_s:g} s (timeout_s): the peer "
                                  "has died, hangs, or has not called the same collective")
        if isinstance(e, (EOFError, ConnectionError)):
            return TransportError(f"connection lost {where} ({e or 'closed by the peer'}): "
                                  "the peer process has probably exited or failed")
        return TransportError(f"error {where}: {e!r}")

    def _mismatch(self, magic: bytes, got: list, call: _Call) -> str:
        peer = self.peers[1]
        if magic != _MAGIC:
            return f"{peer} sent bytes that are not a slipstream header during {call.describe()}"
        kind, dtype, _, seq, numel, _ = got
        theirs = (f"{_KINDS[kind] if kind < len(_KINDS) else kind} #{seq} of {numel} "
                  f"{_DTYPES[dtype] if dtype < len(_DTYPES) else dtype}")
        return (f"collective mismatch with {peer}: it called {theirs}, this rank called "
                f"{call.describe()}; every peer must call the same collectives in the same order "
                "with the same sizes and dtypes")


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, no copy (numpy has no bfloat16: view as uint8)."""
    return memoryview(t.detach().view(torch.uint8).numpy())


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise EOFError("closed by the peer")
        view = view[n:]


def _split(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``parts`` near-equal ranges (some empty when it is short)."""
    n = hi - lo
    return [(lo + n * p // parts, lo + n * (p + 1) // parts) for p in range(parts)]


def _finished(async_op: bool) -> _Work | None:
    if not async_op:
        return None
    future: Future = Future()
    future.set_result(None)
    return _Work(future)


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
    peers = (f"group rank {right} ({every[right][0]})", f"group rank {left} ({every[left][0]})")
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
        for port in ports:
            listeners.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            listeners[-1].setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listeners[-1].bind((address, port))
            listeners[-1].listen(1)
            listeners[-1].settimeout(timeout_s)
    except BaseException:
        for sock in listeners:
            sock.close()
        raise
    return listeners


def _accept(listener: socket.socket, peer: int, c: int, token: bytes, timeout_s: float) -> socket.socket:
    where = f"{':'.join(map(str, listener.getsockname()))} (connection {c})"
    try:
        conn, _ = listener.accept()
    except socket.timeout:
        raise TransportError(f"group rank {peer} did not connect to {where} within {timeout_s:g} s") from None
    conn.settimeout(timeout_s)
    hello = bytearray(_HELLO.size)
    try:
        _recv_exact(conn, memoryview(hello))
    except (OSError, EOFError) as e:
        conn.close()
        raise TransportError(f"the connection to {where} sent no greeting ({e})") from None
    if _HELLO.unpack(hello) != (_MAGIC, token, peer, c):
        conn.close()
        raise TransportError(f"an unexpected connection reached {where}: not group rank {peer} of this set-up")
    return conn


class MultiConnInter:
    """``InterTransport`` over ``connections`` TCP connections to each ring neighbour in
    ``group`` (this rank's peers on the other nodes, one per node). Construction is collective
    over ``group``, which carries the addresses; data never goes through it.

    ``address``/``ports``: where this rank listens; None takes them from ``endpoint_from_env``.
    With ``ports``, each rank listens on K (= ``connections``) ports of its own (see ``_listen``),
    so that every connection of the job has its own port (the emulated cluster's
    per-connection caps key on ports); without, the kernel picks them.
    ``timeout_s``: a peer that sends or takes nothing for this long raises ``TransportError``.
    Tensors: contiguous, CPU, of ``_DTYPES``; ops SUM, PRODUCT, MAX, MIN (AVG is the caller's).
    """

    __slots__ = ("group", "rank", "size", "connections", "timeout_s", "_lanes", "__weakref__")

    def __init__(self, group: dist.ProcessGroup, *, connections: int = 4, timeout_s: float = 300.0,
                 address: str | None = None, ports: range | None = None) -> None:
        if not 1 <= connections <= 16:
            raise ValueError(f"connections must be between 1 and 16, got {connections}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if address is None or ports is None:
            env_address, env_ports = endpoint_from_env()
            address, ports = address or env_address, ports if ports is not None else env_ports
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.connections, self.timeout_s = connections, timeout_s
        self._lanes: _Lanes | None = None
        if self.size > 1:
            self._lanes = _connect(group, self.rank, self.size, connections, timeout_s, address, ports)
            weakref.finalize(self, self._lanes.close)

    def close(self) -> None:
        """Close every connection; later calls raise. Idempotent."""
        if self._lanes is not None:
            self._lanes.close()

    def __enter__(self) -> "MultiConnInter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ collectives

    def all_reduce(self, shard: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False):
        """In place on ``shard`` (any shape, contiguous), like ``dist.all_reduce``."""
        reduce = self._check("all_reduce", op, shard)
        n, r, size = shard.numel(), self.rank, self.size
        if size == 1:
            return _finished(async_op)
        k = self._lanes_for(n * shard.element_size() // (1 if size == 2 else size))
        flat, tmp = shard.view(-1), torch.empty(n, dtype=shard.dtype)
        if size == 2:
            programs = [[(flat[a:b], tmp[a:b], partial(reduce, flat[a:b], tmp[a:b], out=flat[a:b]))]
                        for a, b in _split(0, n, k)]
            return self._submit("all_reduce", shard, programs, async_op)
        blocks = [flat[a:b] for a, b in _split(0, n, size)]
        tmps = [tmp[a:b] for a, b in _split(0, n, size)]
        programs = [self._ring_reduce(blocks, blocks, tmps, reduce, k, c)
                    + self._ring_gather(blocks, blocks[r], k, c) for c in range(k)]
        return self._submit("all_reduce", shard, programs, async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False):
        """``out: (m,)`` gets block ``rank`` of the reduction of every peer's ``inp: (size*m,)``."""
        reduce = self._check("reduce_scatter", op, inp, out, inp.numel() == out.numel() * self.size)
        m = out.numel()
        if m and _overlap(out, inp):
            raise ValueError("reduce_scatter: out overlaps inp; pass a separate output tensor")
        if self.size == 1:
            out.copy_(inp.view_as(out))
            return _finished(async_op)
        blocks = [inp.view(-1)[b * m:(b + 1) * m] for b in range(self.size)]
        tmp = torch.empty(self.size * m, dtype=inp.dtype)
        tmps = [tmp[b * m:(b + 1) * m] for b in range(self.size)]
        tmps[self.rank] = out.view(-1)  # the last step reduces straight into ``out``
        k = self._lanes_for(m * out.element_size())
        programs = [self._ring_reduce(blocks, tmps, tmps, reduce, k, c) for c in range(k)]
        return self._submit("reduce_scatter", inp, programs, async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """``out: (size*m,)`` gets every peer's ``inp: (m,)`` in group-rank order."""
        self._check("all_gather", ReduceOp.SUM, inp, out, out.numel() == inp.numel() * self.size)
        m = inp.numel()
        if self.size == 1:
            out.copy_(inp.view_as(out))
            return _finished(async_op)
        blocks = [out.view(-1)[b * m:(b + 1) * m] for b in range(self.size)]
        k = self._lanes_for(m * inp.element_size())
        programs = [self._ring_gather(blocks, inp.view(-1), k, c) for c in range(k)]
        return self._submit("all_gather", inp, programs, async_op)

    # ------------------------------------------------------------ ring programs (lane c)

    def _ring_reduce(self, inp, acc, tmp, reduce, k: int, c: int) -> list[_Step]:
        """Ring reduce-scatter of piece ``c`` of each block: at step s, send block r-s-1 (the
        input at s = 0, else what step s-1 reduced into ``acc``), receive block r-s-2 into
        ``tmp`` and reduce ``acc = inp op tmp``; block r is complete after size-1 steps."""
        r, size, steps = self.rank, self.size, []
        for s in range(size - 1):
            sb, rb = (r - s - 1) % size, (r - s - 2) % size
            send = (inp if s == 0 else acc)[sb]
            send = send[slice(*_split(0, send.numel(), k)[c])]
            a, b = _split(0, tmp[rb].numel(), k)[c]
            steps.append((send, tmp[rb][a:b], partial(reduce, inp[rb][a:b], tmp[rb][a:b], out=acc[rb][a:b])))
        return steps

    def _ring_gather(self, blocks, mine: torch.Tensor, k: int, c: int) -> list[_Step]:
        """Ring allgather of piece ``c``: step s sends block r-s (``mine`` at s = 0, copied into
        place after it is sent) and receives block r-s-1 into place."""
        r, size, steps = self.rank, self.size, []
        a, b = _split(0, mine.numel(), k)[c]
        for s in range(size - 1):
            sb, rb = (r - s) % size, (r - s - 1) % size
            ra, rb_ = _split(0, blocks[rb].numel(), k)[c]
            if s == 0:
                own = blocks[r][a:b]
                post = None if own.data_ptr() == mine[a:b].data_ptr() else partial(own.copy_, mine[a:b])
                steps.append((mine[a:b], blocks[rb][ra:rb_], post))
            else:
                sa, sb_ = _split(0, blocks[sb].numel(), k)[c]
                steps.append((blocks[sb][sa:sb_], blocks[rb][ra:rb_], None))
        return steps

    # ------------------------------------------------------------ plumbing

    def _check(self, kind: str, op, t: torch.Tensor, other: torch.Tensor | None = None, sizes_ok=True):
        for x in (t,) if other is None else (t, other):
            if x.device.type != "cpu" or not x.is_contiguous():
                raise ValueError(f"{kind}: needs contiguous CPU tensors, got {x.device} "
                                 f"{'contiguous' if x.is_contiguous() else 'non-contiguous'}")
        if t.dtype not in _DTYPES or (other is not None and other.dtype != t.dtype):
            raise ValueError(f"{kind}: dtype {t.dtype} (and output {other.dtype if other is not None else '-'}) "
                             f"not supported: one of {', '.join(map(str, _DTYPES))} for both")
        if not sizes_ok:
            raise ValueError(f"{kind}: output of {other.numel()} and input of {t.numel()} elements: one "
                             f"must hold {self.size} (peers) times the other")
        if op not in _REDUCE:
            raise ValueError(f"{kind}: op {op} not supported (SUM, PRODUCT, MAX, MIN; AVG is a SUM "
                             "and a division by the caller)")
        return _REDUCE[op]

    def _lanes_for(self, step_bytes: int) -> int:
        """Lanes for a step of ``step_bytes`` (the same on every peer whose call matches; lane 0
        always runs, so its header check catches a call that does not)."""
        return max(1, min(self.connections, step_bytes // _MIN_PIECE))

    def _submit(self, kind: str, t: torch.Tensor, programs, async_op: bool):
        work = self._lanes.submit(kind, t, programs)
        if async_op:
            return work
        work.wait()
        return None
