"""Fault injection: a rank that dies, freezes or calls the wrong collective makes every other
rank exit non-zero within the group's timeout (plus a small margin), with a message that
names the cause, and leaves nothing behind in /dev/shm (a segment's name carries the pid of
the process that created it), nor, in the DeepSpeed cases, a torch extension build lock in the
case's own extensions directory.

Each case starts its ranks as separate processes (``_fault_worker.py``) around a store held
by this process, as torchrun's agent holds it, so a dying rank 0 does not take the store with
it and the survivors' own handling is what is measured. ``pytest -m faults`` runs the whole
fault suite (these cases, the launcher's signals, segments, the transport's foreign
connections, bad settings and data). With ``SLIPSTREAM_FAULTS_REPORT=path`` each case appends
its slowest exit, as a multiple of the timeout, to ``path`` (one JSON object per line).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from _extensions import OP, extensions_dir, locks
from slipstream.core_comm.collectives.segment import SHM_DIR

pytestmark = pytest.mark.faults

WORKER = os.path.join(os.path.dirname(__file__), "_fault_worker.py")
TIMEOUT_S = 5.0
MARGIN_S = 3.0  # a survivor's interpreter teardown after the error, on a loaded 2-core machine


def _ours() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("slipstream")} if os.path.isdir(SHM_DIR) else set()


def run_case(tmp_path, case: str, *, nodes: int = 1, per_node: int = 2, victim: int = 1,
             op: str = "all_reduce", env: dict | None = None, pg_timeout: float = TIMEOUT_S) -> dict:
    """Run one case; return each rank's exit code, exit time and output, and the fault time."""
    world = nodes * per_node
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM")}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(world),
                TORCHELASTIC_USE_AGENT_STORE="True", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                FAULT_VICTIM=str(victim), FAULT_OP=op, FAULT_PG_TIMEOUT=str(pg_timeout),
                SLIPSTREAM_TIMEOUT_S=str(TIMEOUT_S))
    base.update(env or {})
    procs, logs = [], []
    for rank in range(world):
        log = open(tmp_path / f"{case}-{rank}.log", "w+")
        rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank % per_node),
                        SLIPSTREAM_NODE=str(rank // per_node))
        procs.append(subprocess.Popen([sys.executable, WORKER, case], env=rank_env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
        logs.append(log)
    ended: dict[int, float] = {}
    deadline = time.time() + 90 + pg_timeout
    try:
        while time.time() < deadline:
            for rank, p in enumerate(procs):
                if rank not in ended and p.poll() is not None:
                    ended[rank] = time.time()
            if all(r in ended for r in range(world) if r != victim):
                break
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        del store
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    faults = [float(m) for out in outputs for m in re.findall(r"^FAULT (\S+)$", out, re.M)]
    pids = {p.pid for p in procs}
    left = sorted(n for n in _ours() if n.split("-")[1].isdigit() and int(n.split("-")[1]) in pids)
    assert not left, f"{case}: shared-memory segments of the case's ranks left in {SHM_DIR}: {left}"
    own = (env or {}).get("TORCH_EXTENSIONS_DIR")  # the case's own: every lock in it is its ranks'
    if own is not None:
        assert not locks(Path(own)), f"{case}: build locks of the case's ranks left behind: {locks(Path(own))}"
    return {"rc": [p.returncode for p in procs], "ended": ended, "out": outputs,
            "fault": max(faults) if faults else None}


def _check(res: dict, case: str, victim: int, cause: str, timeout_s: float = TIMEOUT_S) -> float:
    """Every survivor exited non-zero within the bound, naming ``cause`` (a regex). Returns the
    slowest exit after the fault, as a multiple of the timeout."""
    survivors = [r for r in range(len(res["rc"])) if r != victim]
    assert res["fault"] is not None, f"{case}: the fault did not happen:\n" + "\n".join(res["out"])
    slowest = raised = 0.0
    for r in survivors:
        out = res["out"][r]
        assert r in res["ended"], f"{case}: rank {r} still running {90 + timeout_s:g} s after the fault:\n{out}"
        assert res["rc"][r] not in (0, None), f"{case}: rank {r} exited 0:\n{out}"
        errors = re.findall(r"^ERROR (.*)$", out, re.M)
        assert errors, f"{case}: rank {r} did not report an error:\n{out}"
        assert re.search(cause, errors[0]), f"{case}: rank {r}'s error does not name the cause ({cause}):\n{errors[0]}"
        slowest = max(slowest, res["ended"][r] - res["fault"])
        when = re.findall(r"^RAISED (\S+)$", out, re.M)
        raised = max(raised, float(when[0]) - res["fault"]) if when else raised
    assert slowest <= 1.2 * timeout_s + MARGIN_S, f"{case}: slowest survivor exit {slowest:.1f} s after the fault"
    report = os.environ.get("SLIPSTREAM_FAULTS_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(json.dumps({"case": case, "timeout_s": timeout_s, "slowest_s": round(slowest, 2),
                                "ratio": round(slowest / timeout_s, 3), "slowest_raise_s": round(raised, 2)}) + "\n")
    return slowest / timeout_s


# Who the survivors name: a rank (global or group), its pid, or the store key of a missing rank.
DIED = r"(rank|pid) \d|did not arrive|closed by the peer|connection lost|Connection (closed|reset)"
TIMED = r"within [\d.]+ ?s|timed? ?out|Timed out|no progress"

CASES = [
    # case, nodes, victim, op, extra env, what the survivors' error must name
    ("before_first", 1, 1, "all_reduce", {}, DIED),
    ("before_first", 2, 3, "all_reduce", {"SLIPSTREAM_CONNECTIONS": "2"}, DIED),
    ("setup", 1, 0, "all_reduce", {}, DIED),
    ("setup", 2, 2, "all_reduce", {"SLIPSTREAM_CONNECTIONS": "2"}, DIED),
    ("mid", 1, 1, "all_reduce", {}, DIED),
    ("mid", 1, 0, "reduce_scatter", {}, DIED),
    ("mid", 1, 1, "all_gather", {}, DIED),
    ("mid", 2, 2, "all_reduce", {"SLIPSTREAM_CONNECTIONS": "2"}, DIED),
    ("mid", 2, 1, "reduce_scatter", {"SLIPSTREAM_CONNECTIONS": "2"}, DIED),
    ("mid", 2, 3, "all_gather", {"SLIPSTREAM_CONNECTIONS": "2"}, DIED),
    ("overlapped", 1, 1, "all_reduce", {}, DIED),
    ("overlapped", 2, 3, "reduce_scatter", {"SLIPSTREAM_WIRE": "int8"}, DIED),
    ("queued", 1, 1, "all_reduce", {}, DIED),
    ("queued", 2, 0, "all_reduce", {}, DIED),
    ("queued", 2, 1, "reduce_scatter", {"SLIPSTREAM_CONNECTIONS": "2"}, DIED),
    ("mid", 2, 1, "all_gather", {"SLIPSTREAM_WIRE": "bf16"}, DIED),
    ("frozen", 1, 1, "all_reduce", {}, TIMED),
    ("frozen", 2, 2, "all_reduce", {"SLIPSTREAM_WIRE": "int8"}, TIMED),
    ("frozen", 2, 2, "all_reduce", {"SLIPSTREAM_CONNECTIONS": "2"}, TIMED),
    ("mismatch", 1, 1, "all_reduce", {}, r"differ"),
    ("mismatch", 1, 1, "all_reduce", {"SLIPSTREAM_DEBUG": "1"}, r"differs across ranks.*calls all_reduce of"),
    ("other_call", 1, 1, "all_reduce", {"SLIPSTREAM_DEBUG": "1"}, r"group rank \d calls broadcast"),
    ("other_call", 1, 1, "all_reduce", {}, TIMED + "|" + DIED),
    ("fsdp", 1, 1, "all_gather", {}, DIED),
    ("fsdp", 2, 3, "all_gather", {"SLIPSTREAM_CONNECTIONS": "2"}, DIED),
    ("fsdp", 2, 1, "reduce_scatter", {"SLIPSTREAM_OVERLAP": "1"}, DIED),  # reductions during backward
    ("megatron", 1, 1, "all_reduce", {}, DIED),  # TP=2
    ("megatron", 2, 1, "all_reduce", {"SLIPSTREAM_CONNECTIONS": "2"}, DIED),  # TP=2 in each node x DP=2 across
    ("deepspeed", 1, 1, "all_reduce", {}, DIED),
    ("deepspeed", 2, 2, "all_reduce", {"SLIPSTREAM_CONNECTIONS": "2"}, DIED),
    ("deepspeed", 2, 1, "reduce_scatter", {"SLIPSTREAM_OVERLAP": "1"}, DIED),  # buckets during backward
    ("deepspeed", 2, 1, "reduce_scatter", {"SLIPSTREAM_OVERLAP": "auto"}, DIED),  # in "auto"'s trial steps
    ("deepspeed", 2, 1, "reduce_scatter", {"SLIPSTREAM_OVERLAP": "1", "FAULT_ZERO": "3"}, DIED),  # ZeRO-3's
]


# The default run takes one case of each fault, stack and transport setting (DeepSpeed's:
# ZeRO-3 with overlap; ZeRO-2's ~40 s case runs under -m faults); ``-m faults`` takes them all
# (``matrix``: conftest.py).
DEFAULT_RUN = {"before_first-2node-r3-all_reduce-SLIPSTREAM_CONNECTIONS", "setup-1node-r0-all_reduce",
               "mid-1node-r0-reduce_scatter", "mid-2node-r3-all_gather-SLIPSTREAM_CONNECTIONS",
               "overlapped-2node-r3-reduce_scatter-SLIPSTREAM_WIRE", "frozen-1node-r1-all_reduce",
               "frozen-2node-r2-all_reduce-SLIPSTREAM_WIRE", "mismatch-1node-r1-all_reduce-SLIPSTREAM_DEBUG",
               "other_call-1node-r1-all_reduce-SLIPSTREAM_DEBUG", "fsdp-2node-r1-reduce_scatter-SLIPSTREAM_OVERLAP",
               "megatron-2node-r1-all_reduce-SLIPSTREAM_CONNECTIONS",
               "deepspeed-2node-r1-reduce_scatter-SLIPSTREAM_OVERLAP-FAULT_ZERO"}


def _case_id(c) -> str:
    return f"{c[0]}-{c[1]}node-r{c[2]}-{c[3]}{'-' + '-'.join(c[4]) if c[4] else ''}"


@pytest.mark.parametrize("case,nodes,victim,op,env,cause",
                         [pytest.param(*c, id=_case_id(c),
                                       marks=[pytest.mark.matrix] * (_case_id(c) not in DEFAULT_RUN)) for c in CASES])
@pytest.mark.slow
def test_survivors_exit_within_the_timeout_naming_the_cause(tmp_path, case, nodes, victim, op, env, cause):
    if case == "megatron":
        pytest.importorskip("megatron.core")
    if case == "deepspeed":
        env = {**env, "TORCH_EXTENSIONS_DIR": str(_built_extensions(tmp_path))}
    res = run_case(tmp_path, case, nodes=nodes, victim=victim, op=op, env=env)
    _check(res, case, victim, cause)


def _built_extensions(tmp_path) -> Path:
    """An extensions directory of the case's own with DeepSpeed's op built in it."""
    pytest.importorskip("deepspeed")
    ext = extensions_dir(tmp_path / "ext", built=True)
    if not (ext / OP / f"{OP}.so").exists():
        pytest.skip("DeepSpeed's shm op cannot be built on this machine")
    return ext


def test_the_group_timeout_bounds_a_frozen_rank_when_it_is_the_shorter(tmp_path):
    """``init_process_group(timeout=)`` shorter than ``SLIPSTREAM_TIMEOUT_S``: the group's wins."""
    res = run_case(tmp_path, "frozen", env={"SLIPSTREAM_TIMEOUT_S": "600"}, pg_timeout=TIMEOUT_S)
    _check(res, "frozen (group timeout)", 1, TIMED)
