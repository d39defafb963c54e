"""Candidates compiled beside training: a process of their own compiles them first.

A separate process (``_prebuild``) loads a copy of the model and the step's batch, compiles a
candidate with the training process's backend, threads and inductor settings, and runs one
forward and backward, which fills inductor's on-disk caches (its FX graph and AOTAutograd
caches). Training goes on eagerly meanwhile. The candidate's own compile in the training
process then loads the generated kernels from those caches instead of generating them (BERT-mini
on a 2-core CPU: 3.3 s instead of 22-24 s). The training process still traces, compiles, checks
and times its own graph.

With a core to spare, the process then times a forward and backward of the copy, eager and
compiled in turns (``_prebuild._timed``). A candidate not ``min_speedup`` times faster there is
not compiled in the training process at all (``Prebuilds.lost``): the rest of a step (the
optimizer, the data) takes the same time with either, so over a whole step it would gain less
still. On BERT-mini, that compile in the training loop (its kernels loaded from the cache) was
3.7-3.9 s of the search's 4.3 s. A copy that differs from the model (a patch made outside it
that the copy lacks) can cost time or a candidate's win, never a result.

The process is started fresh, not forked: a child forked from a process whose OpenMP threads
have run hung in its first parallel region (torch 2.13, CPU build, here). So the model goes
to it pickled (``torch.save``); one that does not pickle (a class defined in ``__main__``, a
hook holding a closure) is compiled in the training process as before, and the report says why.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import weakref

import torch

from . import bounded
from ._prebuild import as_sent, autocast_state, forward_as
from .agree import agree
from .diagnose import GraphBreak
from .strategy import Counter

__all__ = ["CONTENTION", "KILL_WAIT_S", "MAX_MODEL_BYTES", "WAIT_POLL_S", "WARM_SHARE", "Prebuild", "Prebuilds",
           "cannot_start", "expected_cost", "first_on_node", "wanted"]

WARM_SHARE = 0.25
"""The training process's own compile of a candidate compiled beside it, as a share of a cold
compile. BERT-mini on 2 cores: inductor 3.1-3.4 s from the cache against 22-24 s cold (0.14),
its regions 0.9 s against 3.3-3.7 s (0.26)."""
CONTENTION = 1.1
"""Seconds training loses per second of the compile process when training's threads already
use every core (a model on the CPU). Measured on 2 cores, BERT-mini (``slipstream bench
compile --models bert --expected-steps 0``): eager steps took 1.3-4.9 s beside it against
0.18 s, at nice 0 and at nice 19 alike; the search cost 45 s with the compile process (38-40 s)
against 27-29 s compiling in the loop. So there it is never expected to pay. With a core to
spare (1 torch thread) the steps beside it kept their 0.30-0.32 s and the search cost 6.6 s
against 27.9 s (benchmarks/results/compile-beside_epyc-2core-kvm_2026-11-26.md)."""
MAX_MODEL_BYTES = 4 << 30
"""Models larger than this (parameters and buffers) are not copied to a compile process."""
WAIT_POLL_S = 0.2
"""How often the training process looks at a compile process it waits for (``Prebuilds.waited``):
it is stopped at most this long after its share has run out."""
KILL_WAIT_S = 10.0
"""The longest wait for a killed compile process to be gone (one in the kernel's uninterruptible
sleep, as in a device driver's call, is left to end by itself)."""


def wanted(choice: bool | None, module: torch.nn.Module, device: torch.device, group=None) -> str | None:
    """Why no candidate may be compiled beside training (``CompileConfig.background``), or None
    when they may; the ranks of ``group`` agree (one all-reduce). None (the default) means on
    for a model on the CPU and off on CUDA (the copy would take device memory beside training)."""
    why = _unwanted(choice, module, device)
    if agree(group, [float(why is not None)])[0] and why is None:
        return "off: not possible on another rank"
    return why


def cannot_start(module: torch.nn.Module, device: torch.device, group=None) -> str | None:
    """Why no compile process can be started for ``module`` at all (``wanted``'s reasons less
    the user's choice and the device's default), or None; the ranks agree."""
    why = _unwanted(True, module, device)
    if agree(group, [float(why is not None)])[0] and why is None:
        return "not possible on another rank"
    return why


def _unwanted(choice: bool | None, module: torch.nn.Module, device: torch.device) -> str | None:
    if choice is False:
        return "off (CompileConfig.background=False)"
    if choice is None and device.type != "cpu":
        return f"off on {device.type} by default (CompileConfig.background=True turns it on)"
    from torch._inductor import config as inductor_config

    if not inductor_config.fx_graph_cache:
        return "off: inductor's FX graph cache is disabled, so a compile elsewhere cannot help"
    held = _process_group_in(module)
    if held:
        return f"off: the model holds a process group ({held}), so it does not pickle for a compile process"
    size = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    if size > MAX_MODEL_BYTES:
        return f"off: the model's {size / 2**30:.1f} GiB is over {MAX_MODEL_BYTES / 2**30:g} GiB to copy"
    return None


def _process_group_in(module: torch.nn.Module) -> str | None:
    """Where ``module`` holds a process group, which no pickle takes, or None: a DTensor
    parameter (FSDP2, tensor parallelism), or a module's or a parameter's attribute that is a
    group or a device mesh (DDP, FSDP1, Megatron's parallel layers, ZeRO-3's parameters). Found
    here, the model is not serialised up to the group only to fail there."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    def group(owner) -> str | None:
        return next((k for k, v in vars(owner).items() if isinstance(v, (torch.distributed.ProcessGroup, DeviceMesh))),
                    None)

    for name, m in module.named_modules():
        if (k := group(m)) is not None:
            return f"{name + '.' if name else ''}{k}"
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            return f"{name}, a DTensor"
        if (k := group(p)) is not None:
            return f"{name}.{k}"
    return None


def first_on_node() -> bool:
    """Whether this process starts the node's compile processes: its first local rank (torchrun's
    ``LOCAL_RANK``), or any process without one. The node's ranks share inductor's cache."""
    return os.environ.get("LOCAL_RANK", "0").strip() in ("", "0")


def expected_cost(compile_s: float, device: torch.device) -> float:
    """What a candidate expected to compile in ``compile_s`` cold costs training when compiled
    beside it: its warm compile here, and on a CPU already busy with training, the cores the
    compile process takes."""
    return compile_s * (WARM_SHARE + (CONTENTION if _busy(device) else 0.0))


def _busy(device: torch.device) -> bool:
    """Whether training on ``device`` already keeps every core busy (its threads on the CPU)."""
    return device.type == "cpu" and torch.get_num_threads() >= (os.cpu_count() or 1)


class Prebuild:
    """One candidate compiled in a process of its own; ``poll`` says when it is done, and stops
    it once it has outrun its share (``bounded``)."""

    __slots__ = ("started", "took_s", "outcome", "outran", "polls", "result", "limit_s", "_proc", "_dir",
                 "_finalizer", "__weakref__")

    def __init__(self, proc: subprocess.Popen, directory: str, limit_s: float) -> None:
        self.started = time.perf_counter()
        self.took_s: float | None = None  # seconds from start to done
        self.outcome: str | None = None  # "ready", or why not; None while running
        self.outran: float | None = None  # where it was stopped for outrunning its share: its expected seconds
        self.polls = 0  # polls while it ran: the autotuner polls once a step
        self.result: dict = {}  # _prebuild's: graphs, and inductor graphs generated and loaded
        self.limit_s = limit_s  # its share: the seconds it may run
        self._proc, self._dir = proc, directory
        self._finalizer = weakref.finalize(self, _stop, proc, directory)

    @classmethod
    def start(cls, module: torch.nn.Module, forward, strategy, args, kwargs, limit_s: float,
              busy: bool, list_breaks: bool = False, timed: bool = False) -> "Prebuild | str":
        """Start compiling ``strategy`` on a copy of ``module`` whose ``forward`` is ``forward``
        (the instance's own, None for the class's), or why it cannot be (a string). ``limit_s``:
        its share, the seconds it may run before it is stopped. ``busy``: training's threads take
        every core, so the compile takes one thread (inductor's default is one per core).
        ``list_breaks``: list the graph breaks there first (``result``'s ``graph_count`` and
        ``graph_breaks``), a dynamo trace the training loop then skips. ``timed``: time eager and
        the candidate there (``result``'s ``timed``), unless ``busy``."""
        directory = tempfile.mkdtemp(prefix=f"slipstream-prebuild-{os.getpid()}-")
        job = {"module": module, "strategy": strategy.name, "args": as_sent(args), "kwargs": as_sent(kwargs),
               "threads": torch.get_num_threads(), "autocast": autocast_state(), "limit_s": limit_s,
               "list_breaks": list_breaks, "timed": timed and not busy}
        try:
            with forward_as(module, forward):
                torch.save(job, os.path.join(directory, "job.pt"))
        except Exception as e:  # noqa: BLE001 - an unpicklable model is compiled here, as before
            shutil.rmtree(directory, ignore_errors=True)
            return f"the model does not pickle for a compile process ({type(e).__name__}: {str(e)[:120]})"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)))
        if busy:
            env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        with open(os.path.join(directory, "log"), "w") as log:
            # a session of its own: its group holds what it starts (inductor's compile workers and
            # autotuning processes), killed with it
            proc = subprocess.Popen([sys.executable, "-m", "slipstream.core_compile.autotune._prebuild", directory,
                                     str(os.getpid())],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        return cls(proc, directory, limit_s)

    def poll(self) -> str | None:
        """None while compiling; then "ready", or why not: stopped for outrunning its share
        (``outran`` set), or failed."""
        if self.outcome is not None:
            return self.outcome
        done = os.path.join(self._dir, "done")  # written whole (renamed into place); the process then waits
        elapsed = time.perf_counter() - self.started
        if os.path.exists(done):
            with open(done) as f:
                self.result = json.load(f)
            self.outcome = "ready"
        elif stop := bounded.outran(elapsed, self.limit_s, bounded.read_progress(self._dir)):
            self.outcome, self.outran = stop
            self._finalizer()  # killed now: its share is spent
        elif (code := _exit_status(self._proc)) is not None:
            self.outcome = f"the compile process failed (exit {code}): {self._last_line()}"
        else:
            self.polls += 1
            return None
        self.took_s = elapsed
        return self.outcome

    def close(self) -> None:
        """Stop the process if it still runs, and delete its files."""
        if self.outcome is None:
            self.outcome = "stopped"
            self.took_s = time.perf_counter() - self.started
        self._finalizer()

    def _last_line(self) -> str:
        try:
            with open(os.path.join(self._dir, "log")) as f:
                lines = [line.strip() for line in f if line.strip()]
        except OSError:
            return "no output"
        return lines[-1][:200] if lines else "no output"


class Prebuilds:
    """A search's compile processes, one per candidate, one per node (its first local rank
    starts them; the node's ranks share inductor's cache)."""

    def __init__(self, group, module: torch.nn.Module, forward, margin: float | None = None) -> None:
        self.group, self.module, self.forward = group, module, forward
        self.margin = margin  # min_speedup, to screen candidates by their timing there; None: no timing
        self.device = torch.device("cpu")  # the model's, set at the first step
        self.beside: set = set()  # the candidates to compile in a compile process first
        self.waited: set = set()  # those of them the training process waits for (the others: beside training)
        self.started: dict = {}  # name -> Prebuild, or why none runs here
        self.failed: set = set()  # compiled beside training without success: compiled here
        self._unstartable: str | None | bool = False  # why no compile process can run, None if one can; False: unasked
        self.listing: tuple | None = None  # (graphs, breaks) listed by a compile process
        self.lost: dict = {}  # name -> why: not margin times faster than eager in its compile process
        self.timed: dict = {}  # name -> (eager's forward and backward over its, its compile s there)

    def cost(self, s, priors, modules: int, choice: bool | None) -> tuple[float, str]:
        """(seconds ``s`` is expected to cost training, where the figure comes from), given
        ``CompileConfig.background`` (``choice``; False where ``wanted`` said no). It is
        compiled beside training (``beside``) when ``choice`` is True, or when None and that
        is expected to cost less than compiling here; the ranks agree. Else a candidate that
        searches kernels (``bounded.searches_kernels``) is compiled in a compile process the
        training process waits for (``waited``), which its share bounds, then here from the
        cache: its cold compile and its warm one; any other is compiled here.

        Dynamic shapes too: the compile process's batch has other lengths than the step's
        that compiles here, yet llama-20m varlen's inductor-dynamic loads both its graphs from
        the cache here (6.4 s against 53 s cold). Before, 2 of its 8 graphs missed (the step's
        views reached the compile process as plain tensors, so its symbolic sizes were named
        otherwise: ``as_sent``) and 3 bypassed AOTAutograd's cache (a ``torch.tensor`` in the
        graph); its compile here took 61-75 s."""
        cold, source = priors.compile_s(s, modules, True)  # a compile process starts cold
        if s.name in self.started:
            return cold * WARM_SHARE, f"{source}; its compile here after the one in a compile process"
        here, source_here = priors.compile_s(s, modules, Counter.in_process == 0)
        beside = expected_cost(cold, self.device)
        worth = choice or (choice is None and beside < here)
        if choice is not False and s.name not in self.failed and agree(self.group, [float(worth)])[0]:
            self.beside.add(s.name)
            return beside, f"{source}; compiled beside training, its cost to training"
        if bounded.searches_kernels(s):
            self.beside.add(s.name)
            self.waited.add(s.name)
            return cold * (1 + WARM_SHARE), f"{source}; in a compile process training waits for, then here"
        return here, source_here

    def unbounded(self, s) -> str | None:
        """Why ``s`` is not compiled at all: it searches kernels, which only a compile process can
        stop (``bounded``), and none can run for this model (``cannot_start``; the ranks agree,
        at the first such candidate)."""
        if not bounded.searches_kernels(s):
            return None
        if self._unstartable is False:
            self._unstartable = cannot_start(self.module, self.device, self.group)
        if self._unstartable is None:
            return None
        return f"its kernel search runs only in a compile process, which can stop it; none can: {self._unstartable}"

    def ready(self, cand, s, args, kwargs, limit_s: float, list_breaks: bool = False) -> bool:
        """Whether candidate ``cand`` (strategy ``s``) may compile in the training process now:
        once the ranks agree that every compile process of it is done (its outcome in
        ``cand.beside``). The first call starts this node's, on this step's batch, to run for
        at most ``limit_s`` (its share); with ``list_breaks`` it lists the graph breaks too
        (``listing``, once it is done). One in ``waited`` is waited for here, polled every
        ``WAIT_POLL_S``; one beside training is polled once a call (a step). Where one failed,
        False, and ``s`` is no longer in ``beside``: the search weighs it again at its cost here;
        but where one outran its share, or failed while searching kernels, ``cand`` is marked
        abandoned, never compiled here."""
        waited = s.name in self.waited
        where = "in a compile process training waited for" if waited else "beside training"
        if s.name not in self.started:  # waited for: training leaves it every core
            self.started[s.name] = (Prebuild.start(self.module, self.forward, s, args, kwargs, limit_s,
                                                   _busy(self.device) and not waited, list_breaks,
                                                   self.margin is not None)
                                    if first_on_node() else f"compiled {where} by the node's first rank")
        pre = self.started[s.name]
        while True:  # bounded: the compile process is stopped once its share is spent (Prebuild.poll)
            running = isinstance(pre, Prebuild) and pre.poll() is None
            outran = (pre.outran or 0.0) if isinstance(pre, Prebuild) else 0.0
            failed = not running and not outran and (pre.outcome != "ready" if isinstance(pre, Prebuild)
                                                     else first_on_node())
            running, failed, outran = agree(self.group, [float(running), float(failed), outran])
            if not (running and waited):
                break
            time.sleep(WAIT_POLL_S)
        if running:
            return False
        if isinstance(pre, Prebuild):
            if "graph_count" in pre.result:
                self.listing = pre.result["graph_count"], [GraphBreak(*b) for b in pre.result["graph_breaks"]]
            cand.background_s = pre.took_s
            meanwhile = "" if waited else f"; {pre.polls} eager steps meanwhile"
            cand.beside = (f"compiled {where} first ({pre.took_s:.1f} s, {pre.result.get('generated')} inductor "
                           f"graphs generated, {pre.result.get('loaded')} loaded from its cache{meanwhile})"
                           if pre.outcome == "ready" else f"not compiled {where}: {pre.outcome}")
        elif first_on_node():  # it could not start here
            cand.beside = f"not compiled {where}: {pre}"
        else:
            cand.beside = f"not compiled {where}: it failed on another rank" if failed else pre
        self.stop(s.name)
        if outran or (failed and bounded.searches_kernels(s)):
            self.beside.discard(s.name)
            mine = isinstance(pre, Prebuild) and pre.outran is not None
            cand.status, cand.outran_s = "abandoned", outran or None
            cand.reason = (pre.outcome if mine else "its compile outran its share on another rank" if outran else
                           "its compile process failed, and in the training process nothing could stop its kernel "
                           "search")
            return False
        if failed:
            self.beside.discard(s.name)
            self.failed.add(s.name)
            del self.started[s.name]
            cand.background_s = None
            return False
        if self.margin is not None:
            self._screen(cand, s.name, pre.result if isinstance(pre, Prebuild) else {})
        return True

    def _screen(self, cand, name: str, result: dict) -> None:
        """Note the timing of candidate ``cand`` in its compile process, and put it in ``lost``
        unless its forward and backward there were ``margin`` times faster than eager's. The
        ranks agree on the mean of the medians over the processes that timed (one per node)."""
        timed = result.get("timed") or {}
        has = min(len(timed.get("eager", ())), len(timed.get("compiled", ()))) >= 2
        mine = ([statistics.median(timed["eager"]), statistics.median(timed["compiled"]), result.get("backend_s", 0.0)]
                if has else [0.0, 0.0, 0.0])
        share, eager, compiled, compile_s = agree(self.group, [float(has), *mine], mean=True)
        if not share:
            return
        self.timed[name] = (eager / compiled, compile_s / share)
        cand.graphs = result.get("graphs", cand.graphs)
        cand.beside += (f"; timed there: a forward and backward {compiled / share * 1e3:.1f} ms against eager's "
                        f"{eager / share * 1e3:.1f} ms (medians); its compile there {compile_s / share:.1f} s")
        if compiled * self.margin >= eager:
            self.lost[name] = (f"not {self.margin:g}x faster than eager's forward and backward in its compile "
                               f"process ({eager / compiled:.2f}x): not compiled in training")

    def abandon(self, cand, name: str) -> None:
        """Where ``name``'s compile process runs beside training, stop it and mark ``cand``, just
        skipped, abandoned: the search's cost has reached its budget meanwhile (the cores the
        process takes from training count), or its graph is no longer worth compiling."""
        if name not in self.started:
            return
        self.stop(name)
        pre = self.started[name]
        cand.status, cand.reason = "abandoned", f"its compile process was stopped: {cand.reason}"
        cand.outran_s = pre.took_s if isinstance(pre, Prebuild) else None

    def stop(self, name: str | None = None) -> None:
        """Stop ``name``'s compile process (None: every one)."""
        for n, pre in self.started.items():
            if isinstance(pre, Prebuild) and name in (None, n):
                pre.close()


def _exit_status(proc: subprocess.Popen) -> int | None:
    """``proc``'s exit status (a signal's number negated), or None while it runs; it is not reaped
    (``waitid``'s ``WNOWAIT``), so its group's id stays its own until ``_stop`` kills the group."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already (SIGCHLD ignored): Popen's own account
        return proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _stop(proc: subprocess.Popen, directory: str) -> None:
    """Kill the compile process's group, ended or not (what it started may outlive it), reap it,
    and delete its files."""
    if proc.returncode is None:  # not reaped: the group's id is still this process's
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=KILL_WAIT_S)
    shutil.rmtree(directory, ignore_errors=True)
