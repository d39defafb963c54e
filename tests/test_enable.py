"""``slipstream.enable()`` / ``disable()``: registration, the default backend for
``init_process_group()`` without a backend, configuration from code and from ``SLIPSTREAM_*``,
and an exact undo. One process, world size 1, on a HashStore."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import slipstream
from _dist import all_gather_single
from slipstream.core_comm.backend import registry
from slipstream.core_comm.backend.process_group import SlipstreamProcessGroup
from slipstream.core_comm.config import CommConfig


@pytest.fixture
def undo():
    """Whatever a test enables is disabled and every group destroyed afterwards."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    slipstream.disable()


def _init(backend=None, **kw):
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
    return dist.group.WORLD


def _torch_state():
    B = dist.Backend
    tables = {name: registry._copy(getattr(B, name)) for name in registry._TABLES}
    return B.__dict__.get("SLIPSTREAM"), tables, dist.monitored_barrier, c10d.monitored_barrier


IMPORT_SCRIPT = r"""
import sys
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
barriers = (dist.monitored_barrier, c10d.monitored_barrier)
maps = dict(dist.Backend.default_device_backend_map)
import slipstream
assert "slipstream" in dist.Backend.backend_list
assert dict(dist.Backend.default_device_backend_map) == maps, "import changed a default backend"
assert (dist.monitored_barrier, c10d.monitored_barrier) == barriers, "import wrapped monitored_barrier"
stacks = {"deepspeed", "accelerate", "transformers", "megatron"} & set(sys.modules)
assert not stacks, f"import slipstream imported {stacks}"
loaded = sorted(m for m in sys.modules if m.partition(".")[0] == "slipstream")
assert len(loaded) <= 20, f"import slipstream loaded {len(loaded)} of its modules: {loaded}"
heavy = [m for m in loaded if any(p in m for p in (".varlen", ".autotune", ".collectives", ".communicator"))]
assert not heavy, f"import slipstream loaded {heavy} before their first use"
assert callable(slipstream.status) and callable(slipstream.compile)  # loaded on first use
slipstream.enable()
assert dist.monitored_barrier.__wrapped__ is barriers[0]  # the shim keeps the original reachable
slipstream.disable()
assert (dist.monitored_barrier, c10d.monitored_barrier) == barriers, "disable left monitored_barrier wrapped"
assert dict(dist.Backend.default_device_backend_map) == maps
print("ok")
"""


def test_import_registers_the_backend_loads_little_and_changes_nothing_else():
    out = subprocess.run([sys.executable, "-c", IMPORT_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


MISSING_STACKS = r"""
import sys
for stack in ("deepspeed", "accelerate", "megatron", "transformers"):
    sys.modules[stack] = None  # Python's mark for a module that cannot be imported: as if not installed
import torch.distributed as dist  # under SLIPSTREAM=1 the start-up hook enables here
import slipstream
assert slipstream.is_enabled() == (sys.argv[1] == "1")
slipstream.enable()
assert dist.Backend.default_device_backend_map["cpu"] == "slipstream"
slipstream.status()
slipstream.disable()
assert not slipstream.is_enabled()
print("ok")
"""


@pytest.mark.parametrize("env", ["0", "1"])
def test_enable_and_the_start_up_hook_work_without_any_optional_stack(env):
    """A plain torch install (none of DeepSpeed, accelerate, megatron-core, transformers): the
    adapters' import hooks are skipped, not a ModuleNotFoundError from ``find_spec("megatron.core")``
    (torch 2.11's image without megatron found it)."""
    out = subprocess.run([sys.executable, "-c", MISSING_STACKS, env], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "SLIPSTREAM": env})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok") and "could not" not in out.stderr, out.stderr[-3000:]


def test_enable_makes_slipstream_the_default_and_disable_restores_exactly(undo):
    before = _torch_state()
    slipstream.enable()
    slipstream.enable()  # idempotent
    assert slipstream.is_enabled()
    assert dist.Backend.default_device_backend_map["cpu"] == "slipstream"
    assert dist.get_default_backend_for_device("cuda") == "nccl"  # CUDA stays on NCCL
    pg = _init()
    assert isinstance(pg, SlipstreamProcessGroup)
    dist.destroy_process_group()
    slipstream.disable()
    slipstream.disable()  # a no-op now
    after = _torch_state()
    assert after[0] == before[0] and after[1] == before[1]
    assert after[2] is before[2] and after[3] is before[3]
    assert not isinstance(_init(), SlipstreamProcessGroup)


def test_a_named_backend_is_kept(undo):
    slipstream.enable()
    assert not isinstance(_init("gloo"), SlipstreamProcessGroup)
    assert dist.get_backend() == "gloo"


def test_config_from_code_env_and_pg_options(undo, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CHUNK_BYTES", str(1 << 20))
    assert _init("slipstream")._config == CommConfig(chunk_bytes=1 << 20)  # environment
    dist.destroy_process_group()
    slipstream.enable(CommConfig(shm=False))
    assert _init()._config == CommConfig(shm=False)  # enable(config) wins over the environment
    dist.destroy_process_group()
    assert _init(pg_options=CommConfig(debug=True))._config == CommConfig(debug=True)  # per group


def test_enable_rejects_what_is_not_a_config():
    with pytest.raises(TypeError, match="CommConfig"):
        slipstream.enable({"shm": False})
    assert not slipstream.is_enabled()


def test_single_rank_group_collectives_and_monitored_barrier(undo):
    pg = _init("slipstream")
    t = torch.arange(10.0)
    dist.all_reduce(t)
    out = torch.empty(10)
    all_gather_single(out, t)
    dist.monitored_barrier()  # torch refuses non-gloo names; slipstream's barrier is gloo's
    assert torch.equal(out, torch.arange(10.0))
    assert pg.name() == "slipstream" and dist.get_backend() == "slipstream"
    assert pg.communicator is None  # one rank: nothing to accelerate, nothing built
