"""Stopping a job: SIGTERM or SIGINT to ``slipstream finetune`` stops every rank within seconds
and the launcher exits non-zero, whatever the ranks are doing (starting, building DeepSpeed's
op, waiting on a build lock, training), leaving no build lock of its ranks behind.

Each case has an extensions directory of its own (``_extensions``): its ranks build, lock and
get killed there, never in the machine's shared one.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from _extensions import OP, extensions_dir, locks

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.faults

from slipstream.plugins.deepspeed.build_lock import Mark  # noqa: E402


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in os.listdir(f"/proc/{parent}/task") if os.path.isdir(f"/proc/{parent}/task") else ():
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            found.update(kids)
            todo.extend(kids)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _namespaces_of(pid: int) -> list[str]:
    """The emulated nodes' namespaces made by launcher ``pid`` (named ``slipstream-<pid>-...``;
    other people's clusters on this machine come and go meanwhile)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return [line for line in out.splitlines() if line.startswith(f"slipstream-{pid}-")]


def _wait_for(condition, what: str, output: list, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"the job did not reach {what} in {timeout:g} s:\n{''.join(output[-40:])}"
        time.sleep(0.2)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


STEP_DONE = re.compile(r"finetune \[\w+\].*\| *[1-9]\d*/\d+ \[")  # the progress bar past step 0
WAITING = "waiting for the torch extension build lock"

CASES = [
    # signal, emulated nodes, the ranks' phase when it comes, SIGINT inherited ignored (as by a
    # script's background job, where Python raises no KeyboardInterrupt: the launcher must stop anyway)
    (signal.SIGTERM, 1, "training", False),
    (signal.SIGINT, 1, "training", True),
    (signal.SIGTERM, 2, "training", False),
    (signal.SIGINT, 2, "training", True),
    (signal.SIGINT, 1, "starting", False),
    (signal.SIGTERM, 1, "building", False),
    (signal.SIGINT, 1, "lock", False),
]
# Left to ``-m faults`` (conftest.py): the default run keeps one training case of each signal.
MATRIX = [(signal.SIGINT, 1, "training", True), (signal.SIGTERM, 2, "training", False)]


@pytest.mark.parametrize(
    "sig,nodes,phase,sigint_ignored",
    [pytest.param(*c, marks=[pytest.mark.netns] * (c[1] > 1) + [pytest.mark.matrix] * (c in MATRIX)) for c in CASES],
    ids=[f"{c[0].name}-{c[1]}node-{c[2]}{'-inherited-ignored' * c[3]}" for c in CASES],
)
@pytest.mark.slow
def test_a_signal_to_the_launcher_stops_every_rank(tmp_path, sig, nodes, phase, sigint_ignored):
    ext = extensions_dir(tmp_path / "ext", built=phase != "building")
    held = None
    if phase == "lock":  # marked by this live process: a build the ranks must wait for, not remove
        (ext / OP).mkdir(exist_ok=True)
        held = Mark.of_process(os.getpid()).text()
        (ext / OP / "lock").write_text(held)
    per_node = 2 if nodes == 1 else 1
    proc = subprocess.Popen(
        [sys.executable, "-m", "slipstream.cli", "finetune", "--steps", "200", "--samples", "64",
         "--max-length", "128", "--no-varlen", "--nodes", str(nodes), "--nproc", str(per_node),
         "--output-dir", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}, preexec_fn=_ignore_sigint if sigint_ignored else None,
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        expected = nodes * (1 + per_node)  # each node's launcher and its ranks
        _wait_for(lambda: len(_descendants(proc.pid)) >= expected, "its ranks", output, timeout=120)
        if phase == "building":
            _wait_for(lambda: (ext / OP / "lock").exists(), "the op's build", output)
            time.sleep(1)  # ninja and the compiler at work
        elif phase == "lock":
            _wait_for(lambda: any(WAITING in line for line in output), "the lock wait", output)
        elif phase == "training":
            _wait_for(lambda: any(STEP_DONE.search(line) for line in output), "training", output)
        ranks = _descendants(proc.pid)
        sent = time.monotonic()
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
    deadline = sent + 15
    while time.monotonic() < deadline and any(_alive(p) for p in ranks):
        time.sleep(0.2)
    assert proc.returncode != 0, "".join(output[-40:])
    assert not [p for p in ranks if _alive(p)], "ranks still running after the launcher stopped"
    if nodes > 1:
        assert not _namespaces_of(proc.pid), "the emulated nodes' namespaces were not deleted"
    if held is None:
        assert not locks(ext), f"build locks left behind: {locks(ext)}"
    else:
        assert locks(ext) == [ext / OP / "lock"] and (ext / OP / "lock").read_text() == held, \
            "a lock the ranks did not make was removed or changed"
