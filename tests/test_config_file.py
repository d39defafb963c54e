"""``SLIPSTREAM_CONFIG`` alone: the file's ``"comm"`` settings reach every group of a job that
names no other config, a plain DDP script and a megatron-core script under torchrun, as
``slipstream.status()`` shows and as the path each collective took shows."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from _dist import free_port

DDP = r"""
import json, os, torch, torch.distributed as dist
import slipstream
dist.init_process_group()  # no backend named: SLIPSTREAM_CONFIG turned slipstream on
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1024, 1024))  # one 4 MiB bucket
for _ in range(2):
    model(torch.randn(8, 1024)).pow(2).mean().backward()
"""

# after the DDP script, in the same job: megatron-core's groups are built after the first ones
MEGATRON = r"""
from megatron.core import parallel_state
parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
for numel in (1 << 10, 1 << 20):  # 4 KiB and 4 MiB on the tensor-parallel group
    dist.all_reduce(torch.ones(numel), group=parallel_state.get_tensor_model_parallel_group())
"""

REPORT = r"""
st = slipstream.status()
if dist.get_rank() == 0:
    print("STATUS " + json.dumps({"configs": [g["config"] for g in st["groups"]], "settings": st["comm_settings"],
                                  "enabled_by": st["enabled_by"],
                                  "paths": sorted(st["collectives"].get("all_reduce", {}))}), flush=True)
dist.barrier()
os._exit(0)  # torch 2.13's gloo aborts at exit in ~1 run of 5 (stock too): not what is compared here
"""


def _run(tmp_path, script: str, comm: dict) -> dict:
    (tmp_path / "job.py").write_text(script + REPORT)
    (tmp_path / "slipstream.json").write_text(json.dumps({"enabled": True, "comm": comm}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM")}
    env.update(SLIPSTREAM_CONFIG=str(tmp_path / "slipstream.json"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--log-dir", str(tmp_path / "logs"),
           "--nproc-per-node", "2", "--master-port", str(free_port()), str(tmp_path / "job.py")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("STATUS ")]
    return json.loads(line.removeprefix("STATUS "))


@pytest.mark.parametrize("comm, paths", [({}, {"cma"}), ({"cma": False}, {"shm"}), ({"shm": False}, {"stock"})],
                         ids=["defaults", "no-cma", "no-shm"])
@pytest.mark.slow
def test_the_files_comm_settings_reach_every_group(tmp_path, comm, paths):
    """A plain DDP script, then megatron-core's groups in the same job (where installed)."""
    megatron = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core")
    got = _run(tmp_path, DDP + (MEGATRON if megatron else ""), comm)
    assert got["enabled_by"] == "SLIPSTREAM_CONFIG", got
    assert bool(got["configs"]) == ("stock" not in paths), got  # no shared memory: no communicator
    assert len(got["configs"]) == (0 if "stock" in paths else 2 if megatron else 1), got  # the world's, TP's
    for config in [got["settings"], *got["configs"]]:  # new groups and every built one: the file's
        assert all(config[k] == v for k, v in comm.items()), (config, comm)
    if megatron and "stock" not in paths:  # the 4 KiB call takes the one-node path too
        assert set(got["paths"]) == paths | {"shm"}, got
    else:
        assert paths <= set(got["paths"]) and set(got["paths"]) <= paths | {"shm"}, got
