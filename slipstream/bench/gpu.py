"""``slipstream bench gpu``: the GPU check in one command, within 9 minutes (``--time-limit``).

Stages, each in a process of its own (``workers/gpu.py``) under its own timeout; one that
fails or times out is a FAILED row with its reason, and the stages after it still run. The
report is always written (``benchmarks/results/gpu_<device>_<date>.md``, or ``--out``): the
table (one row per stage and case), what failed, the machine and versions, the command.

1. ``versions``: Python, torch (CUDA, NCCL), transformers, deepspeed, flash-attn, the GPU.
2. ``probe``: the stream-race probe (``workers/gpu_probe.py``) on a 1-rank NCCL group: every
   async wrapper slipstream returns (the ``slipstream`` backend's plain and coalesced
   all-gather, the pool's communicator, FSDP2's custom all-gather, DeepSpeed's stand-in, the
   DDP hook) waited as its consumer waits after a call issued on a side stream held back by
   ``torch.cuda._sleep``: race or no race; a stock handle is the control, and the same without
   a wait must race.
3. ``comm``: 4 ranks sharing the GPU over gloo with CUDA tensors (``workers/gpu_comm.py``):
   the race probe of the staged path, then the core's staged all-reduce, reduce-scatter and
   all-gather of 64 MiB bf16 against gloo's own, in turns, medians and ratios, results checked
   against gloo's.
4. ``varlen``: ``bench varlen`` on a 153M-parameter Llama with grouped-query attention, bf16,
   batch 64 of alpaca-format samples: padded vs each varlen backend there (flash, torch_varlen,
   compiled flex) vs Hugging Face's flattening (``workers/gpu_varlen.py``).
5. ``compile``: ``bench compile`` on that model with varlen, told its run length: the whole
   run with compile on against eager, and the strategy chosen.
6. ``pytest``: ``pytest -m gpu`` over the repository's tests, its summary line and each failed
   test with its error.
7. ``suite``: the CPU tests that reach into the frameworks' internals (``workers/gpu.SUITE_FILES``),
   CUDA hidden, on the machine's own torch and transformers, several at a time.

A stage's time is its share of ``--time-limit`` (``Stage.seconds``, scaled down when the limit
is shorter) plus what the stages before it left unused, so the whole run stays within the
limit (a stage past its time gets SIGTERM, then SIGKILL 5 s later). ``--dry-run`` runs every
stage on the CPU at toy sizes (1-rank gloo instead of NCCL, a tiny model, a few steps, the
skipped GPU tests) so that the test suite keeps the command working.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from .report import parse_size, table

__all__ = ["STAGES", "Outcome", "Stage", "add_arguments", "each_stage", "run", "run_stages"]


@dataclass(frozen=True)
class Stage:
    name: str
    """``workers/gpu.py``'s stage of that name."""
    title: str
    seconds: float
    """Its time on the GPU, before any scaling or time left over: they add up to 530 s, 10 s
    short of 9 minutes for the command's own start and its last stage's stop."""
    command: tuple[str, ...] = ()
    """The process to run instead of ``workers/gpu.py`` (a stand-in, for the tests); it gets
    the same ``--stage``, ``--ctx``, ``--rows`` and ``--out`` arguments."""


STAGES = (
    Stage("versions", "1. versions", 15),
    Stage("probe", "2. stream-race probe, 1 rank", 45),
    Stage("comm", "3. ranks sharing one GPU over gloo (staged)", 75),
    Stage("varlen", "4. varlen step", 70),  # 118 s of 199 on an H200, flex's 90 s included
    Stage("compile", "5. compile told its run length", 80),
    Stage("pytest", "6. pytest -m gpu", 130),
    Stage("suite", "7. CPU tests on this machine's torch", 115),  # 9 files did not finish in 118 s
)

_KILL_GRACE_S = 5.0

ALPACA_SAMPLES = 1000
"""Samples ``bench varlen`` generates (``recipes.alpaca``'s default): the batches of its warm-up,
timed and exactness steps come from them."""


@dataclass
class Outcome:
    """What one stage gave: its rows (``[case, result, detail]``), what it wrote to ``--out``,
    its time and why it failed (None: it did not)."""

    stage: Stage
    rows: list = field(default_factory=list)
    data: dict = field(default_factory=dict)
    seconds: float = 0.0
    limit: float = 0.0
    cpu_s: float = 0.0
    """CPU seconds of the stage's processes (those that ended: user + system)."""
    failure: str | None = None
    log_tail: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true",
                        help="every stage on the CPU at toy sizes (what the test suite runs)")
    parser.add_argument("--out", help="the report (default benchmarks/results/gpu_<device>_<date>.md)")
    parser.add_argument("--json", help="write every stage's rows and records here")
    parser.add_argument("--time-limit", type=float, default=530.0, help="seconds for all stages (default 530)")
    parser.add_argument("--stages", default=",".join(s.name for s in STAGES),
                        help=f"comma-separated, of {', '.join(s.name for s in STAGES)} (default all)")
    parser.add_argument("--batch-size", type=int, help="varlen samples per step (default 64; dry run 3)")
    parser.add_argument("--steps", type=int, help="varlen timed steps per case (default 10; dry run 2)")
    parser.add_argument("--comm-size", help="the collectives' full buffer (default 64M; dry run 256K)")
    parser.add_argument("--compile-steps", type=int, help="steps of each whole run of compile (default 200; dry run 6)")


def _context(args: argparse.Namespace, workdir: str) -> dict:
    """What every stage reads: the device, sizes (toy ones on a dry run), paths."""
    dry = args.dry_run

    def pick(given, gpu, cpu):
        return given if given is not None else (cpu if dry else gpu)

    return {
        "dry_run": dry, "device": "cpu" if dry else "cuda", "workdir": workdir,
        "repo": str(Path(__file__).resolve().parents[2]),
        "ranks": 2 if dry else 4, "comm_bytes": parse_size(pick(args.comm_size, "64M", "256K")),
        "comm_iters": 3 if dry else 10,
        "model": "llama-gqa-tiny" if dry else "llama-150m", "batch_size": pick(args.batch_size, 64, 3),
        "steps": pick(args.steps, 10, 2), "warmup": 0 if dry else 1, "compile_steps": pick(args.compile_steps, 200, 6),
        "compile_batch": 2 if dry else 8, "compile_budget_s": 60,
        # one torch thread a process on the CPU: tiny ops on 2 threads of a busy 2-core machine
        # spin at OpenMP's barriers (a tiny llama's step took 3.4 s on 2 threads, 0.05 s on 1)
        "threads": 1 if dry else 0,
    }


def run_stages(stages: Sequence[Stage], ctx: dict, *, time_limit: float, workdir: str) -> list[Outcome]:
    """Run ``stages`` in order, each in its own process and session, each within its time
    (its share of ``time_limit`` plus what the earlier ones left); every stage runs."""
    return list(each_stage(stages, ctx, time_limit=time_limit, workdir=workdir))


def each_stage(stages: Sequence[Stage], ctx: dict, *, time_limit: float, workdir: str) -> Iterator[Outcome]:
    """``run_stages``, one outcome at a time (what a caller interrupted midway still has)."""
    scale = min(1.0, time_limit / max(sum(s.seconds for s in stages), 1e-9))
    carried = 0.0
    for stage in stages:
        limit = stage.seconds * scale + carried
        outcome = _run_stage(stage, ctx, limit, workdir) if limit >= 1.0 else Outcome(
            stage, limit=limit, failure=f"not run: {max(limit, 0):.0f} s left of --time-limit")
        carried = limit - outcome.seconds  # negative after a stage that overran by its kill grace
        if outcome.failure is not None:
            outcome.rows.append([stage.title if not outcome.rows else "", "-", "FAILED", outcome.failure])
        sys.stdout.write(f"{stage.title}: {outcome.failure or 'done'} ({outcome.seconds:.0f} s, "
                         f"{outcome.cpu_s:.0f} s CPU)\n")
        sys.stdout.flush()
        yield outcome


def _run_stage(stage: Stage, ctx: dict, limit: float, workdir: str) -> Outcome:
    base = Path(workdir) / stage.name
    rows_path, out_path, log_path = (base.with_suffix(s) for s in (".rows.jsonl", ".json", ".log"))
    command = list(stage.command or (sys.executable, "-m", "slipstream.bench.workers.gpu"))
    command += ["--stage", stage.name, "--ctx", json.dumps({**ctx, "seconds": limit}), "--rows", str(rows_path),
                "--out", str(out_path)]
    started, cpu = time.monotonic(), _children_cpu_s()
    failure = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
            failure = None if code == 0 else f"exit code {code}"
        except subprocess.TimeoutExpired:
            failure = f"timed out after {limit:.0f} s"
            _stop(proc, signal.SIGTERM)
        finally:
            _stop(proc, signal.SIGKILL)  # whatever the stage left in its session
    outcome = Outcome(stage, seconds=time.monotonic() - started, limit=limit, cpu_s=_children_cpu_s() - cpu)
    outcome.log_tail = log_path.read_text(errors="replace")[-3000:]
    if rows_path.exists():
        for line in rows_path.read_text().splitlines():
            row = json.loads(line)
            outcome.rows.append([stage.title if not outcome.rows else "", row["case"], row["result"], row["detail"]])
    if failure is None and out_path.exists():
        outcome.data = json.loads(out_path.read_text())
    elif failure is None:
        failure = "wrote no result"
    if failure is not None:
        outcome.failure = f"{failure}: {_reason(outcome.log_tail)}" if failure.startswith("exit") else failure
    elif not outcome.rows:
        outcome.failure = "no rows"
    return outcome


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _stop(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to ``proc``'s session (its process group) and wait up to ``_KILL_GRACE_S``
    for the stage to go (after SIGKILL too: a process stuck in the GPU driver may never go)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        return
    try:
        proc.wait(timeout=_KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass


def _reason(log: str) -> str:
    """The line of a failed stage's log that says why: its last error line, else its last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0] or line.startswith(("SystemExit", "Killed"))]
    return (errors or lines or ["no output"])[-1][:300]


def _cell(text) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def _report(outcomes: list[Outcome], command: str, started: str, total_s: float, limit: float, dry: bool) -> str:
    versions = next((o.data for o in outcomes if o.stage.name == "versions"), {})
    gpu = (versions.get("gpu") or {}).get("name")
    where = "a CPU dry run (toy sizes)" if dry else (gpu or "a GPU")
    failed = [o.stage.title for o in outcomes if o.failure]
    lines = [f"# `slipstream bench gpu` on {where}, {started}", "",
             *table(["stage", "case", "result", "details"], "llll",
                    [[_cell(c) for c in row] for o in outcomes for row in o.rows]), "",
             f"{len(outcomes)} stages in {total_s:.0f} s of a {limit:.0f} s limit; "
             + (f"FAILED: {', '.join(failed)}" if failed else "every stage ran to its end")
             + (f"; {bad} rows FAILED" if (bad := sum(row[2] == "FAILED" for o in outcomes for row in o.rows))
                else "; no row FAILED") + ". Each stage's time: "
             + ", ".join(f"{o.stage.name} {o.seconds:.0f} s of {o.limit:.0f} ({o.cpu_s:.0f} s CPU)"
                         for o in outcomes) + "."]
    for o in outcomes:
        if o.failure:
            lines += ["", f"## {o.stage.title}: {o.failure}", "", "Its log's last lines:", "", "```",
                      *o.log_tail.splitlines()[-25:], "```"]
    lines += ["", "## Machine and versions", "", *_machine_lines(versions), "", "## Command", "", "```bash",
              command, "```", ""]
    return "\n".join(lines)


def _machine_lines(versions: dict) -> list[str]:
    if not versions:
        return ["unknown: the versions stage failed (see above)"]
    m, v, gpu = versions["machine"], versions["versions"], versions.get("gpu")
    lines = [f"- GPU: {gpu['name']} ({gpu['capability']}, {gpu['memory_gib']} GiB), {gpu['count']} device(s); "
             f"CUDA {v['cuda']}, NCCL {versions['nccl']}" if gpu else "- GPU: none",
             f"- CPU: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; kernel {m['kernel']}",
             f"- Python {v['python']}, torch {v['torch']}, transformers {v['transformers'] or 'not installed'}, "
             f"deepspeed {v['deepspeed'] or 'not installed'}, flash-attn {v['flash_attn'] or 'not installed'}",
             f"- slipstream {v['slipstream']} at {v['commit']}"]
    return lines


def _command(args: argparse.Namespace) -> str:
    parts = ["slipstream bench gpu"] + (["--dry-run"] if args.dry_run else [])
    for name in ("time_limit", "stages", "batch_size", "steps", "comm_size", "compile_steps", "out", "json"):
        value = getattr(args, name)
        default = {"time_limit": 530.0, "stages": ",".join(s.name for s in STAGES)}.get(name)
        if value is not None and value != default:
            parts += ["--" + name.replace("_", "-"), f"{value:g}" if isinstance(value, float) else str(value)]
    return " ".join(parts)


def _default_out(outcomes: list[Outcome], dry: bool, date: str) -> Path:
    versions = next((o.data for o in outcomes if o.stage.name == "versions"), {})
    device = versions.get("device_tag") or "unknown"
    return Path("benchmarks/results") / f"gpu_{device}{'-dry-run' if dry else ''}_{date}.md"


def _selected(names: str) -> list[Stage]:
    by = {s.name: s for s in STAGES}
    unknown = [n for n in names.split(",") if n not in by]
    if unknown:
        raise SystemExit(f"unknown stage {unknown[0]!r}; known: {', '.join(by)}")
    return [s for s in STAGES if s.name in names.split(",")]


def _interrupted(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    stages = _selected(args.stages)
    if args.time_limit <= 0:
        raise SystemExit("--time-limit must be > 0")
    try:
        parse_size(args.comm_size or "1")
    except ValueError as e:
        raise SystemExit(f"--comm-size: {e}") from None
    batch, steps = args.batch_size or 64, args.steps or 10
    if batch < 1 or steps < 1 or batch * (steps + 2) > ALPACA_SAMPLES:
        raise SystemExit(f"--batch-size x (--steps + 2) must be within the {ALPACA_SAMPLES} generated samples "
                         "bench varlen draws its batches from")
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device here: run with --dry-run (the CPU at toy sizes) or on a GPU machine")
    command = _command(args)
    sys.stdout.write(command + "\n")
    started, begin = time.strftime("%Y-%m-%d %H:%M"), time.monotonic()
    previous = signal.signal(signal.SIGTERM, _interrupted)  # a scheduler's stop: the report is still written
    try:
        return _run(args, stages, command, started, begin)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace, stages: list[Stage], command: str, started: str, begin: float) -> int:
    with tempfile.TemporaryDirectory(prefix="slipstream-bench-gpu-", ignore_cleanup_errors=True) as workdir:
        outcomes: list[Outcome] = []
        try:
            for outcome in each_stage(stages, _context(args, workdir), time_limit=args.time_limit, workdir=workdir):
                outcomes.append(outcome)
        finally:  # the report is written whatever happened, with the stages that ran
            report = _report(outcomes, command, started, time.monotonic() - begin, args.time_limit, args.dry_run)
            out = Path(args.out) if args.out else _default_out(outcomes, args.dry_run, started.split()[0])
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(report)
            sys.stdout.write(f"report: {out}\n")
            if args.json:
                Path(args.json).write_text(json.dumps(
                    [{"stage": o.stage.name, "rows": o.rows, "data": o.data, "seconds": o.seconds, "limit": o.limit,
                      "cpu_s": o.cpu_s, "failure": o.failure} for o in outcomes], indent=1, default=str))
    return 1 if any(o.failure for o in outcomes) else 0

