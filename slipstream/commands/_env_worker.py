"""One rank of ``slipstream env``: builds the communicator the way training does, asks it what
it would run and why, and loads the tuned plan (cache, else cost model)."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict

import torch
import torch.distributed as dist

from slipstream.cluster.worker import run_worker
from slipstream.config import SlipstreamConfig
from slipstream.core_comm import Communicator, pool
from slipstream.core_comm.topology import host_identity, node_key_from_env
from slipstream.core_comm.tuner.measure import collective_buffers
from slipstream.core_comm.ops import KINDS
from slipstream.core_comm.tuner import TuneKey, default_cache_dir, load_plan
from slipstream.plugins.deepspeed.translate import zero_buckets
from slipstream.plugins.fsdp.translate import wrap_policy_kwargs

_PROBE_SIZES = (4 << 10, 1 << 20, 64 << 20)  # full buffers, as `slipstream bench comm`


def _has_transport() -> bool:
    try:
        from slipstream.core_comm.transport import tcp as transport  # noqa: F401
    except ImportError:
        return False
    return True


def _fast_paths(comm: Communicator) -> dict:
    """Per fast path: whether it is active, and why not."""
    topo, cfg = comm.topology, comm.config
    off = comm.unavailable or ("the group has one rank" if comm.world == 1 else "")
    shm_why = off or ("" if comm.shm is not None else "every node holds one rank")
    hier_why = off or ("" if comm.hier is not None else "the group spans one node")
    conn_why = ((hier_why or "no inter-node path") if comm.hier is None
                else "connections=1 (SLIPSTREAM_CONNECTIONS)" if cfg.connections == 1 else "")
    staging_why = ("no CUDA device" if not torch.cuda.is_available()
                   else off or pool.decide(None, "cuda", torch.float32, config=cfg) or "")
    return {
        "shm": {"active": comm.shm is not None, "why_not": shm_why},
        "cuda_staging": {"active": not staging_why, "why_not": staging_why},
        "hierarchical": {"active": comm.hier is not None, "why_not": hier_why, "nodes": topo.num_nodes},
        "multi_connection": {"active": not conn_why, "why_not": conn_why, "connections": cfg.connections,
                             "transport_importable": _has_transport()},
    }


def _routes(comm: Communicator, plan) -> list[dict]:
    rows = []
    for kind in KINDS:
        for nbytes in _PROBE_SIZES:
            _, inp = collective_buffers(kind, nbytes, torch.float32, comm.world)
            comm.plan = None
            algo, why = comm.algorithm(inp, kind=kind)
            comm.plan = plan
            tuned, tuned_why = comm.algorithm(inp, kind=kind)
            choice = plan.choose(kind, inp.numel() * inp.element_size(), inp.dtype)
            rows.append(dict(kind=kind, size_bytes=nbytes, dtype="float32", algorithm=algo, reason=why,
                             tuned_algorithm=tuned, tuned_reason=tuned_why,
                             tuned_chunk_bytes=choice.chunk_bytes if choice else None))
    comm.plan = None
    return rows


def probe(args: argparse.Namespace) -> dict:
    comm = pool.get(None)
    topo = comm.topology
    ranks: list = [None] * comm.world
    dist.all_gather_object(ranks, {"host": host_identity(), "node_key": node_key_from_env(), "pid": os.getpid()})
    cache_dir = args.cache_dir or str(default_cache_dir())
    plan = load_plan(comm, cache_dir=cache_dir)
    key = TuneKey.of(comm)
    settings = SlipstreamConfig.from_env()  # the SLIPSTREAM_CONFIG file's whole section as the job reads it
    result = {
        "world_size": comm.world,
        "backend": str(dist.get_backend()),
        "topology": {"num_nodes": topo.num_nodes, "node_sizes": list(topo.node_sizes), "node_of": list(topo.node_of),
                     "uniform": topo.is_uniform, "blocked": topo.is_blocked,
                     "ranks": [{"rank": r, "node": topo.node_of[r], **info} for r, info in enumerate(ranks)]},
        "config": comm.config.to_dict(),
        "settings": settings.to_dict() if settings is not None else None,
        "fast_paths": _fast_paths(comm),
        "unavailable": comm.unavailable,
        "routes": _routes(comm, plan),
        "tuned": {"source": plan.source, "cache_file": os.path.join(cache_dir, key.filename()),
                  "key": key.to_json(), "connections": plan.connections,
                  "buckets": {**asdict(plan.buckets), "ddp": plan.buckets.ddp_kwargs(),
                              "deepspeed": zero_buckets(plan.buckets), "fsdp": wrap_policy_kwargs(plan.buckets)},
                  "choices": [{k: r[k] for k in ("kind", "dtype", "nbytes", "algorithm", "chunk_bytes", "source")}
                              for r in plan.rows()]},
    }
    comm.close()
    return result


if __name__ == "__main__":
    run_worker(probe, options={"--cache-dir": None})
