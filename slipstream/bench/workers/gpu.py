"""One stage of ``slipstream bench gpu``, in a process of its own:
``python -m slipstream.bench.workers.gpu --stage NAME --ctx JSON --rows FILE --out FILE``.

A stage appends its table rows to ``--rows`` as it goes (one JSON object a line: ``case``,
``result``, ``detail``), so that what it measured before a timeout survives it, and writes what
else it found to ``--out`` at the end. ``ctx`` (``gpu.py``'s ``_context``) holds the sizes, the
device, the work directory and ``seconds``, the stage's time: every wait inside is bounded by
it. SIGTERM (the command's timeout) unwinds like an exception, so the launches and
subprocesses a stage started are stopped on the way out.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from slipstream.cluster.worker import run_worker

__all__ = ["Rows", "STAGES", "device_tag"]


class Rows:
    """The stage's table rows, appended to a JSON-lines file as they come."""

    def __init__(self, path: str) -> None:
        self.path = path

    def add(self, case: str, result: str, detail: str = "") -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"case": case, "result": result, "detail": detail}) + "\n")


def device_tag(name: str) -> str:
    """A GPU's short name for a file name: "NVIDIA H100 80GB HBM3" -> "h100",
    "NVIDIA GeForce RTX 4090" -> "rtx4090", "NVIDIA A100-SXM4-80GB" -> "a100"."""
    words = [w for w in name.replace("-", " ").split() if w.lower() not in ("nvidia", "tesla", "geforce", "amd")]
    tag = ""
    for w in words:
        tag += re.sub(r"[^a-z0-9]", "", w.lower())
        if any(ch.isdigit() for ch in w):
            break
    return tag or "gpu"


def _left(deadline: float, margin: float = 10.0) -> float:
    """Seconds an inner wait may take: to the stage's deadline, less ``margin`` for the waiter to
    stop what it started (the launcher: SIGTERM, then SIGKILL 5 s later)."""
    return max(deadline - time.monotonic() - margin, 1.0)


def versions(ctx: dict, rows: Rows, deadline: float) -> dict:
    """Python, torch (its CUDA and NCCL), transformers, deepspeed, flash-attn, the GPU, slipstream."""
    import torch

    from slipstream._common.version import __version__
    from slipstream.bench.report import machine, version

    found = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "transformers": version("transformers"), "deepspeed": version("deepspeed"),
             "flash_attn": version("flash_attn") or version("flash-attn"), "slipstream": version("slipstream") or __version__,
             "commit": _commit(ctx["repo"])}
    rows.add("python", found["python"])
    nccl = _nccl_version() if torch.cuda.is_available() else None
    rows.add("torch", found["torch"], f"CUDA {found['cuda'] or 'none'}" + (f", NCCL {nccl}" if nccl else ""))
    for name in ("transformers", "deepspeed", "flash_attn"):
        rows.add(name.replace("_", "-"), found[name] or "not installed")
    rows.add("slipstream", f"{found['slipstream']} ({found['commit']})")
    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {"name": props.name, "capability": f"sm_{props.major}{props.minor}", "count": torch.cuda.device_count(),
               "memory_gib": round(props.total_memory / 2**30, 1)}
        rows.add("GPU", props.name, f"{gpu['capability']}, {gpu['memory_gib']} GiB, {gpu['count']} device(s)")
    else:
        rows.add("GPU", "none", "the CPU dry run" if ctx["dry_run"] else "no CUDA device")
    return {"versions": found, "gpu": gpu, "machine": machine(), "nccl": nccl,
            "device_tag": device_tag(gpu["name"]) if gpu else "cpu"}


def _nccl_version() -> str | None:
    import torch

    try:
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):  # a build without NCCL
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _commit(repo: str) -> str:
    """The repository's commit, ``+ local changes`` when its tracked files differ from it."""
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "commit unknown"
    return (head or "commit unknown") + (" + local changes" if head and dirty else "")


def probe(ctx: dict, rows: Rows, deadline: float) -> dict:
    """The race probe (``gpu_probe``) of every async wrapper on a 1-rank group in this process
    (NCCL for CUDA tensors); the staged path's is the next stage's, on its ranks."""
    import torch

    from . import gpu_probe

    cuda = ctx["device"] == "cuda"
    where = "1 rank, NCCL" if cuda else "1 rank, gloo, CPU"
    found = []

    def record(r: dict) -> None:
        rows.add(r["name"], *gpu_probe.row(r))
        found.append(r)

    gpu_probe.one_rank(torch.device("cuda", 0) if cuda else torch.device("cpu"), on_result=record)
    rows.add(f"verdict ({where})", *gpu_probe.verdict(found, cuda))
    return {"results": found}


def comm(ctx: dict, rows: Rows, deadline: float) -> dict:
    """Ranks sharing one GPU over gloo (``gpu_comm``): the race probe of the staged path, then the
    core's staged collectives against gloo's own; rank 0 writes the rows."""
    from slipstream.cluster import ClusterSpec
    from slipstream.cluster.worker import launch_worker

    argv = ["--bytes", str(ctx["comm_bytes"]), "--iters", str(ctx["comm_iters"]), "--warmup", "2",
            "--rows", rows.path, *([] if ctx["device"] == "cuda" else ["--cpu"])]
    return launch_worker("slipstream.bench.workers.gpu_comm", argv, ClusterSpec(nodes=1, ranks_per_node=ctx["ranks"]),
                         timeout=_left(deadline), quiet=True)


def compile_stage(ctx: dict, rows: Rows, deadline: float) -> dict:
    """``bench compile`` on the varlen llama, told its run length: whole run with compile vs eager."""
    import argparse

    from slipstream.bench import compile as bench_compile

    from .gpu_varlen import model_dir, parameters

    out = Path(ctx["workdir"]) / "compile.json"
    # sdpa: bench compile's llama trains in fp32, where flash and torch_varlen cannot run and
    # flex would compile its kernels inside eager's steps
    argv = ["--models", "llama", "--llama-model", model_dir(ctx["model"], ctx["workdir"]), "--varlen-backend", "sdpa",
            "--device", ctx["device"],
            "--steps", str(ctx["compile_steps"]), "--batch-size", str(ctx["compile_batch"]),
            "--budget-s", str(ctx["compile_budget_s"]), "--timeout", f"{_left(deadline, 15):.0f}", "--json", str(out),
            *(["--threads", str(ctx["threads"])] if ctx["threads"] else [])]
    parser = argparse.ArgumentParser(prog="slipstream bench compile")
    bench_compile.add_arguments(parser)
    bench_compile.run(parser.parse_args(argv))
    (r,) = json.loads(out.read_text())
    case = (f"{ctx['model']} ({parameters(ctx['model']) / 1e6:.1f}M, fp32), varlen sdpa, batch "
            f"{ctx['compile_batch']}, told {ctx['compile_steps']} steps")
    if "error" in r:
        rows.add(case, "FAILED", r["error"].strip().splitlines()[-1][:300] if r["error"].strip() else "no output")
        return r
    s, rep = r["summary"], r["report"]
    rows.add(case, f"chose {rep['chosen']}; whole run {s['run_ratio']:.3f}x eager's",
             f"eager run {s['eager_run_s']:.1f} s, compile-on run {s['tuned_run_s']:.1f} s; decided at step "
             f"{rep['decided_at_step']}; search cost {s['search_cost_s']:.1f} s ({100 * s['search_share']:.1f}% of "
             f"the eager run); budget {rep['budget_s'] or 0:.1f} s ({rep['budget_basis']}); loss rel. diff "
             f"{s['loss_rel_diff']:.1e}")
    return r


SUITE_FILES = ("test_backend.py", "test_communicator.py", "test_ddp.py", "test_deepspeed_plugin.py",
               "test_enable.py", "test_fsdp.py", "test_hierarchical.py", "test_nccl_routing.py", "test_varlen.py")
"""The CPU tests the ``suite`` stage runs on the GPU machine's own torch and transformers: those
that reach into torch's, DeepSpeed's and transformers' internals (the suite is tested on one
torch; a GPU image often holds another)."""
DRY_SUITE_TEST = "test_enable.py::test_enable_makes_slipstream_the_default_and_disable_restores_exactly"
"""What a dry run's ``suite`` stage runs: one test in a pytest process, as the stage runs its files."""


def pytest_stage(ctx: dict, rows: Rows, deadline: float) -> dict:
    """``pytest -m gpu`` in the repository (on a dry run, the ``tests/test_gpu_*.py`` files): its
    summary line and the failed tests with their errors; past the stage's time, what ran and the
    test it stopped in."""
    tests = Path(ctx["repo"]) / "tests"
    paths = sorted(str(p) for p in tests.glob("test_gpu_*.py")) if ctx["dry_run"] else [str(tests)]
    case = "pytest -m gpu" + (" (tests/test_gpu_*.py)" if ctx["dry_run"] else "")
    return _pytest(ctx, rows, deadline, case, ["-m", "gpu", *paths])


def suite_stage(ctx: dict, rows: Rows, deadline: float) -> dict:
    """``SUITE_FILES`` of the CPU tests, CUDA hidden, on this machine's torch, several at a time
    where pytest-xdist is installed (on a dry run: one test of ``test_enable.py``, which the suite
    runs whole anyway)."""
    tests = Path(ctx["repo"]) / "tests"
    files = (DRY_SUITE_TEST,) if ctx["dry_run"] else SUITE_FILES
    workers = 0 if ctx["dry_run"] or not importlib.util.find_spec("xdist") else min(8, (os.cpu_count() or 2) // 2)
    what = "1 test" if ctx["dry_run"] else f"{len(files)} files"
    case = f"CPU tests, CUDA hidden ({what}" + (f", {workers} at a time)" if workers else ")")
    return _pytest(ctx, rows, deadline, case, ["-m", "not gpu", *(["-n", str(workers)] if workers else []),
                                               *(str(tests / f) for f in files)], env={"CUDA_VISIBLE_DEVICES": ""})


def _pytest(ctx: dict, rows: Rows, deadline: float, case: str, args: list, env: dict | None = None) -> dict:
    """Run pytest with ``args`` in the repository within the stage's time: one row, its summary
    and each failed test with its error (pytest's short summary)."""
    if not (Path(ctx["repo"]) / "tests").is_dir():
        rows.add(case, "FAILED", f"no tests directory in {ctx['repo']} (an installed copy, not a checkout)")
        return {}
    log, limit = Path(ctx["workdir"]) / f"pytest-{re.sub(r'[^a-z]+', '-', case.lower())[:40]}.log", _left(deadline)
    errors = log.with_suffix(".failures.jsonl")
    errors.unlink(missing_ok=True)
    # one test's compile (flex's) must not take the stage's whole time: each test gets a third of it
    each = ["--timeout", str(max(30, int(limit / 3)))] if importlib.util.find_spec("pytest_timeout") else []
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider",
                                 "-p", "slipstream.bench.pytest_failures", *each, *args],
                                cwd=ctx["repo"], stdout=f, stderr=subprocess.STDOUT, preexec_fn=_default_sigint,
                                env={**os.environ, "COLUMNS": "300", "SLIPSTREAM_PYTEST_FAILURES": str(errors),
                                     **(env or {})})
        try:
            code = proc.wait(timeout=max(limit - 8, 1.0))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # pytest stops and prints the short summary of what failed so far
            try:
                proc.wait(timeout=6)
            except subprocess.TimeoutExpired:
                proc.kill()  # its ranks, in this stage's session, go with the stage
                proc.wait()
            code = None
    text = log.read_text(errors="replace")
    sys.stdout.write(text[-20000:])
    failed = _failures(text, errors.read_text(errors="replace") if errors.exists() else "")
    said = "; ".join(f"{name}: {why}" if why else name for name, why in failed.items())
    if code is None:
        done = _outcomes(text)
        counts = ", ".join(f"{n} {o.lower()}" for o, n in sorted(Counter(o for _, o in done).items()))
        # a test's id alone on a line: started (serially, the last one; under xdist, each one scheduled)
        started = dict.fromkeys(re.findall(r"^(\S+::\S+) *$", text, re.M))
        stuck = [t for t in started if t not in dict(done)][-8:]
        rows.add(case, "FAILED", f"timed out after {limit:.0f} s; so far {counts or 'nothing'}"
                 + (f"; stopped in {', '.join(stuck)}" if stuck else "") + (f"; failed: {said}" if said else ""))
        return {"returncode": None, "failed": list(failed)}
    summary = next((line.strip("= ") for line in reversed(text.splitlines())
                    if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)|no tests ran", line)),
                   f"exit code {code}, no summary line")
    rows.add(case, summary, said)
    return {"returncode": code, "summary": summary, "failed": list(failed)}


def _default_sigint() -> None:
    """In pytest's process, before it starts: SIGINT as Python handles it by default. A process
    started in the background of a shell without job control inherits SIGINT ignored, and a
    Python started so never raises KeyboardInterrupt (the stop below would go unheard)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


_OUTCOME = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"


def _outcomes(text: str) -> list[tuple[str, str]]:
    """(test, outcome) of each test ``pytest -v`` reported: ``path::test OUTCOME`` serially,
    ``[gw0] [ 5%] OUTCOME path::test`` under pytest-xdist."""
    return (re.findall(rf"^(\S+::\S+) ({_OUTCOME})", text, re.M)
            + [(t, o) for o, t in re.findall(rf"^\[gw\d+\] \[ *\d+%\] ({_OUTCOME}) (\S+::\S+)", text, re.M)])


def _failures(text: str, reported: str = "") -> dict[str, str]:
    """Each failed test (file::name) and its error: from pytest's short summary (``-rfE``), else
    from the lines ``bench/pytest_failures.py`` wrote (``reported``: a run cut short under xdist prints
    no summary); a failed test that neither reached, with no error."""
    found = {}
    for test, outcome in _outcomes(text):
        if outcome in ("FAILED", "ERROR"):
            found.setdefault(test.split("/")[-1], "")
    for line in reported.splitlines():
        try:
            seen = json.loads(line)
        except ValueError:
            continue  # a line cut short by the stop
        found[seen["test"].split("/")[-1]] = seen["error"].strip()[:200]
    for test, why in re.findall(r"^(?:FAILED|ERROR) (\S+::\S+)(?: - (.*))?$", text, re.M):
        found[test.split("/")[-1]] = (why or found.get(test.split("/")[-1]) or "").strip()[:200]
    return found


def varlen(ctx: dict, rows: Rows, deadline: float) -> dict:
    from .gpu_varlen import stage

    return stage(ctx, rows, deadline)


STAGES = {"versions": versions, "probe": probe, "comm": comm, "varlen": varlen, "compile": compile_stage,
          "pytest": pytest_stage, "suite": suite_stage}


def _interrupted(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(args) -> dict:
    signal.signal(signal.SIGTERM, _interrupted)
    ctx = json.loads(args.ctx)
    if ctx.get("threads"):
        import torch

        torch.set_num_threads(ctx["threads"])
    deadline = time.monotonic() + ctx["seconds"]
    return STAGES[args.stage](ctx, Rows(args.rows), deadline) or {}


if __name__ == "__main__":
    run_worker(main, options={"--stage": str, "--ctx": str, "--rows": str}, group=None, threads=None)
