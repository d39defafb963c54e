"""DeepSpeed's CPU shared-memory allreduce: the peer of ``slipstream bench comm`` on one node.

What it is: the ``deepspeed_shm_comm`` op (``deepspeed/ops/csrc/cpu/comm/shm.cpp`` and
``shm_interface.cpp``, built by ``ShareMemCommBuilder`` in ``deepspeed/ops/op_builder/cpu/comm.py``).
Stock DeepSpeed builds it in ``TorchBackend.__init__`` (``deepspeed/comm/torch.py``,
``build_shm_op``) and calls ``torch.ops.deepspeed.inference_all_reduce_`` from
``inference_all_reduce`` (the AutoTP inference path); its training ``all_reduce`` goes to
``torch.distributed`` instead. We call the registered op directly, as that method does once its
checks pass, without DeepSpeed's module-global communicator.

What it supports (DeepSpeed 0.19.8, read from its source):

- allreduce only, SUM only: the op takes no reduce-op argument (``inference_all_reduce`` drops
  its ``op`` on this path), so another op would silently be summed;
- the whole world, no group: ``initialize(world_size, rank)`` maps one segment per rank;
- float32 (needs AVX2), bfloat16 and float16 (need AVX512BW; ``vector_kernel_level()``);
  other dtypes return unreduced, silently, so :func:`prepare` refuses them;
- every rank on one node: it is only set up when the ``LOCAL_SIZE`` environment variable equals
  the world size (DeepSpeed's launcher sets it; ``torch.distributed.run`` does not, so
  :func:`connect` does); segment names come from ``MASTER_ADDR`` / ``MASTER_PORT``;
- any size: 32 MiB chunks; a chunk under 1 MiB is reduced whole by every rank, a larger one
  reduce-scattered and all-gathered through the segments. The fp32 sum is taken in rank order
  (bf16/fp16 upcast to fp32 and rounded once), not in gloo's order: on general data the two
  differ by rounding; the bench checks on integer-valued data, which every order sums exactly.
- waits spin without yielding: with more ranks than cores a waiting rank holds a core until
  the scheduler preempts it.

The op is JIT-built with ninja and g++ ``-fopenmp`` into torch's extension cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) the first time (92 s once on
the shared 2-core machine of benchmarks/results; a cached load about 1 s with the import);
:func:`prepare` times it apart from the collectives.
Its segments (66 MiB per rank) are never unlinked by DeepSpeed; :func:`connect` unlinks them
once every rank has mapped them. DeepSpeed is imported only here, only when this peer runs.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["Availability", "algorithm", "connect", "prepare"]

# dtype -> the vector_kernel_level() its reduce kernel needs (shm_interface.cpp)
_KERNEL_LEVEL = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 2}
_NAIVE_THRESHOLD = 1 << 20  # NAIVE_ALLREDUCE_THRESHOLD in shm.cpp
_SEGMENT = "/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"  # SHM_BUFFER_NAME scheme


@dataclass(frozen=True)
class Availability:
    """Whether the peer can run here, and what getting it ready cost."""

    reason: str | None
    """Why it cannot run (one line), or None when it can."""
    setup_s: float = 0.0
    """Seconds to import DeepSpeed and JIT-build (or load the cached build of) the op."""
    version: str = ""
    """DeepSpeed's version."""


def _load():
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    builder = ShareMemCommBuilder()
    if not builder.is_compatible():
        raise RuntimeError(f"ShareMemCommBuilder is not compatible here: {builder.error_log}")
    return builder.load(verbose=False)


def prepare(dtype: torch.dtype, nodes: int) -> Availability:
    """In the launching process: build the op (ranks then load the cached build) and check it
    can run ``dtype`` on this layout."""
    if nodes != 1:
        return Availability(f"needs every rank on one node; this run has {nodes} nodes")
    if dtype not in _KERNEL_LEVEL:
        names = ", ".join(str(d).removeprefix("torch.") for d in _KERNEL_LEVEL)
        return Availability(f"reduces {names} only; {str(dtype).removeprefix('torch.')} would come back unreduced")
    start = time.perf_counter()
    try:
        import deepspeed

        module = _load()
    except ImportError as e:
        return Availability(f"deepspeed is not importable ({e}); pip install deepspeed")
    except Exception as e:  # a failed JIT build raises anything from RuntimeError to CalledProcessError
        return Availability(f"the op did not build or load: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    setup = time.perf_counter() - start
    level = module.vector_kernel_level()
    if level < _KERNEL_LEVEL[dtype]:
        return Availability(f"this CPU lacks the vector ISA its {dtype} kernel needs (level {level})", setup)
    return Availability(None, setup, deepspeed.__version__)


def connect(rank: int, world_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """On every rank, after ``init_process_group``: set up the segments and return the op, an
    in-place SUM allreduce over the whole world of a contiguous tensor."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if local != world_size:
        raise RuntimeError(f"DeepSpeed's shm allreduce needs all {world_size} ranks on this node, found {local}")
    os.environ["LOCAL_SIZE"] = str(world_size)  # read by the op's initialize(), see the module docstring
    module = _load()
    module.initialize(world_size, rank)
    dist.barrier()  # every rank has mapped every segment: the names can go
    env = os.environ
    segment = _SEGMENT.format(uid=os.getuid(), addr=env.get("MASTER_ADDR", ""), port=env.get("MASTER_PORT", ""),
                              rank=rank)  # fmt: skip
    if os.path.exists(segment):
        os.unlink(segment)
    else:
        warnings.warn(f"no {segment}: DeepSpeed names its segments otherwise now; they stay in /dev/shm")
    return torch.ops.deepspeed.inference_all_reduce_


def algorithm(nbytes: int) -> str:
    """What the op runs on a buffer of ``nbytes`` (per 32 MiB chunk)."""
    if nbytes < _NAIVE_THRESHOLD:
        return "shm: every rank reduces the whole buffer"
    return "shm: reduce-scatter + all-gather"
