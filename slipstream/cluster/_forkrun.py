"""One node's launcher that imports what its ranks import once, then forks the ranks.

``python -c BOOTSTRAP --nnodes N --node-rank I --nproc-per-node P --master-addr A --master-port Q
[--preload m1,m2] (SCRIPT | -m MODULE) ARGS...``, ``BOOTSTRAP`` setting ``OMP_NUM_THREADS=1``
(unless set) before ``slipstream``, and so torch, is imported: torch's OpenMP reads it once.

``emulated.py`` starts it in place of ``torch.distributed.run`` on a machine without an
accelerator. A rank of a Llama job spends about 6 s of CPU importing torch and transformers on
these machines; forked from this process, a node pays it once. It preloads the modules named by
``--preload`` and those the script or module imports at its top level, then forks the ranks
with torchrun's worker environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_*``;
``OMP_NUM_THREADS=1`` unless set) and torchrun's failure rule: the first rank to fail stops the
node's others (SIGTERM, then SIGKILL after 5 s) and the launcher exits 1 naming it. SIGTERM,
SIGINT and SIGHUP to the launcher reach every rank. Node 0's launcher hosts the store the ranks
meet at, as torchrun's agent does: it outlives a rank 0 that dies. Each rank runs the script or module as ``__main__``
and ends as an interpreter does: non-daemon threads joined, exit handlers run.

Not for a process that has initialised CUDA (a forked child cannot use it): the launchers keep
``torch.distributed.run`` where an accelerator is available, or where
``SLIPSTREAM_LAUNCHER=torchrun``. Where the imports started a thread (a forked child would hold
none of it, and could find a lock it held), this launcher becomes ``torch.distributed.run``
for the same node and says so.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import importlib
import importlib.util
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Sequence

BOOTSTRAP = ("import os, sys; os.environ.setdefault('OMP_NUM_THREADS', '1'); "  # as torchrun does
             "from slipstream.cluster._forkrun import main; sys.exit(main())")
_STOP_GRACE_S = 5.0
_STORE_TIMEOUT_S = 600.0  # torchrun's rendezvous bound
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    at = 0  # the entry: ``-m`` or the first word that is not an option's (every option takes a value)
    while at < len(argv) and argv[at] != "-m" and argv[at].startswith("--"):
        at += 1 if "=" in argv[at] else 2
    parser = argparse.ArgumentParser(prog="python -m slipstream.cluster._forkrun",
                                     usage="%(prog)s [options] (SCRIPT | -m MODULE) ARGS...")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=0, help="0: a free one (one node only)")
    parser.add_argument("--preload", default="", help="modules to import before forking, comma-separated")
    parser.add_argument("--log-dir", default="", help="torch.distributed.run's, where this launcher becomes it")
    args = parser.parse_args(argv[:at])
    entry = argv[at:]
    if not entry or entry == ["-m"]:
        parser.error("a script or -m MODULE is needed")
    args.module, args.rest = (entry[1], entry[2:]) if entry[0] == "-m" else (None, entry)
    if args.master_port == 0 and args.nnodes > 1:
        parser.error("--master-port is needed with more than one node")
    return args


def _entry_file(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(the file the rank runs, its package for relative imports)."""
    if args.module is None:
        return os.path.abspath(args.rest[0]), None
    try:
        spec = importlib.util.find_spec(args.module)
    except (ImportError, ValueError):
        return None, None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None, None
    return spec.origin, args.module.rpartition(".")[0] or None


def top_level_imports(path: str, package: str | None) -> list[str]:
    """The modules ``path`` imports in its top-level statements (not inside functions or an
    ``if __name__ == "__main__"`` block), relative ones resolved against ``package``; for
    ``from m import x``, ``m.x`` too, which may be a module (a name that is not fails to import,
    and is skipped)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = node.module if node.level == 0 else _resolve(node.level, node.module, package)
            if base:  # the module, and each name of it that may be a submodule
                names += [base, *(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")]
    return [n for n in names if n]


def _resolve(level: int, module: str | None, package: str | None) -> str | None:
    """The absolute name of ``from <level dots><module> import ...`` in ``package``."""
    parts = (package or "").split(".") if package else []
    if level - 1 >= len(parts):
        return None
    base = ".".join(parts[:len(parts) - (level - 1)])
    return f"{base}.{module}" if module else base


def _preload(names: Sequence[str]) -> list[str]:
    """Import each of ``names`` that imports; the ranks raise a failing one's error themselves."""
    done = []
    for name in dict.fromkeys(names):
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception:  # noqa: BLE001 - a rank that needs it fails with its own traceback
            pass
    return done


def _worker_env(args: argparse.Namespace, port: int) -> dict[str, str]:
    """The environment torchrun gives every worker of this node, less the rank's own."""
    world = args.nnodes * args.nproc_per_node
    return {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(args.nproc_per_node),
            "GROUP_RANK": str(args.node_rank), "GROUP_WORLD_SIZE": str(args.nnodes),
            "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def _torchrun_argv(args: argparse.Namespace, port: int) -> list[str]:
    """torch's launcher for the same node and entry."""
    entry = ["-m", args.module, *args.rest] if args.module is not None else list(args.rest)
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(args.nnodes), "--node-rank",
            str(args.node_rank), "--nproc-per-node", str(args.nproc_per_node), "--master-addr", args.master_addr,
            "--master-port", str(port), *(["--log-dir", args.log_dir] if args.log_dir else []), *entry]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host_store(args: argparse.Namespace, port: int):
    """The job's TCPStore, served from this process (``TORCHELASTIC_USE_AGENT_STORE``: every rank
    connects to it as a client, retrying until it is up)."""
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE")  # the ranks have theirs: with it, torch ignores a failed bind
    return dist.TCPStore(args.master_addr, port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=_STORE_TIMEOUT_S))


def _run_rank(args: argparse.Namespace, rank: int, local: int, saved: dict) -> None:
    """The forked rank's life: its variables, the entry run as ``__main__``, an interpreter's
    exit. Never returns."""
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local), ROLE_RANK=str(rank))
    code = 0
    try:
        if args.module is not None:
            sys.argv = [args.module, *args.rest]
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args.rest)
            sys.path[0] = os.path.dirname(os.path.abspath(args.rest[0]))
            runpy.run_path(args.rest[0], run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit code 1
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's join of non-daemon threads
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _exit_code(value: object) -> int:
    """``SystemExit.code`` as the interpreter turns it into an exit status."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


class _Stop(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum: int, frame: object) -> None:
    raise _Stop(signum)


def _stop(children: dict[int, int], sig: int = signal.SIGTERM) -> None:
    """``sig`` to every child still running, SIGKILL to those alive after the grace period."""
    for pid in children:
        _kill(pid, sig)
    deadline = time.monotonic() + _STOP_GRACE_S
    while children and time.monotonic() < deadline:
        _reap(children)
        time.sleep(0.05)
    for pid in list(children):
        _kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        del children[pid]


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _reap(children: dict[int, int]) -> list[tuple[int, int]]:
    """(rank, exit code) of each child that ended, removed from ``children`` (pid -> rank)."""
    ended = []
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            ended.append((children.pop(pid), os.waitstatus_to_exitcode(status)))
    return ended


def _supervise(children: dict[int, int]) -> int:
    """Wait for every rank; the first failure stops the rest. Returns the launcher's exit code."""
    while children:
        for rank, code in _reap(children):
            if code != 0:
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                print(f"slipstream launcher: rank {rank} failed ({how}); stopping this node's other ranks",
                      file=sys.stderr, flush=True)
                _stop(children)
                return 1
        time.sleep(0.05)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    port = args.master_port or _free_port()
    environ = dict(os.environ)  # torch.distributed.run's, where this launcher becomes it
    os.environ.update(_worker_env(args, port))
    path, package = _entry_file(args)
    if args.module is None:
        sys.path[0] = os.path.dirname(path)  # type: ignore[arg-type]
    preload = [n for n in args.preload.split(",") if n]
    if path is not None and os.path.exists(path):
        preload += top_level_imports(path, package)
    started = time.monotonic()
    loaded = _preload(preload)
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
    if threads > 1:  # a forked child holds none of them, and may find a lock one of them held
        print(f"slipstream launcher: importing the ranks' modules started {threads - 1} thread(s), which forked "
              "ranks would not have: starting each rank with torch.distributed.run", file=sys.stderr, flush=True)
        argv = _torchrun_argv(args, port)
        os.execve(argv[0], argv, environ)
    if args.node_rank == 0:
        print(f"slipstream launcher: {args.nnodes} node(s) x {args.nproc_per_node} ranks forked after importing "
              f"{len(loaded)} modules once per node ({time.monotonic() - started:.1f} s); "
              "SLIPSTREAM_LAUNCHER=torchrun starts each rank afresh", file=sys.stderr, flush=True)
    saved = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    children: dict[int, int] = {}
    try:
        for sig in _SIGNALS:
            if saved[sig] is not signal.SIG_IGN or sig == signal.SIGINT:
                signal.signal(sig, _on_signal)
        for local in range(args.nproc_per_node):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_rank(args, args.node_rank * args.nproc_per_node + local, local, saved)
            children[pid] = args.node_rank * args.nproc_per_node + local
        store = _host_store(args, port) if args.node_rank == 0 else None  # after forking: no thread is forked
        code = _supervise(children)
        del store
        return code
    except _Stop as stop:
        for sig in _SIGNALS:  # a second signal does not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        _stop(children, stop.signum if stop.signum != signal.SIGHUP else signal.SIGTERM)
        return 128 + stop.signum
    finally:
        _stop(children)  # what is still running after an error here (the store's port taken): none left behind


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # too late for torch, imported with the package: use BOOTSTRAP
    sys.exit(main())
