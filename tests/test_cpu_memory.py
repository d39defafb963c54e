"""``keep_freed_memory`` against glibc's default: page faults of a step that allocates and
frees the same large tensors again, each case in a fresh process (the setting is process-wide)."""

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

_CYCLES = """
import json, resource, sys, torch
from slipstream.plugins import cpu_memory
mode = sys.argv[1]
if mode != "default":
    assert cpu_memory.keep_freed_memory() and cpu_memory.keep_freed_memory()  # idempotent
if mode == "released":
    cpu_memory.release_freed_memory()
    assert not cpu_memory.is_keeping_freed_memory()

def step():  # 64 MiB and 16 MiB tensors, allocated and freed as a step's activations are
    a = torch.ones(16 << 20)
    b = torch.ones(4 << 20)
    return float(a[-1] + b[-1])

for _ in range(3):  # the heap settles into its layout in the first steps
    step()
faults = []
for _ in range(7):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(sorted(faults)[3]))  # a step's, the median: one heap extension in a loaded run is not a step's
"""


def _faults_per_step(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _CYCLES, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_kept_memory_is_reused_without_page_faults_and_release_restores_glibc():
    default, kept, released = (_faults_per_step(m) for m in ("default", "kept", "released"))
    # glibc maps and unmaps both tensors every step: 20480 faults of 4 KiB pages (40 with
    # 2 MiB transparent huge pages); kept, the heap reuses the same memory.
    assert default >= 32, default
    assert kept <= default / 10, (kept, default)
    assert released >= default / 2, (released, default)
