"""``initialize``: ``deepspeed.initialize`` plus the top-level ``"slipstream"`` config section.

The section (see ``slipstream.config``) turns on the fast collectives for every ZeRO stage
and, optionally, the padding-removal pass on the model. Without a section, or with
``"enabled": false``, this is exactly ``deepspeed.initialize``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import logging
import os
import sys

import torch

from ..._common import record
from ..._common.record import deferred, note_stack, warn_once
from .._adapter import apply_job_effects, compile_model, note_overlap_choice, read_config, undo_job_effects
from ..._common.patch import patch, unpatch
from ...core_comm import pool
from ...core_comm.tuner import load_plan
from . import build_lock
from .comm_backend import install_comm
from .translate import run_length, zero_buckets
from .gather import patch_gather_ahead
from .zero import overlaps, patch_zero3_optimizer, patch_zero_optimizer

__all__ = ["initialize", "install", "uninstall", "load_ds_config", "bucket_defaults"]

log = logging.getLogger("slipstream.deepspeed")


def load_ds_config(config=None, args=None, config_params=None) -> dict:
    """The DeepSpeed config as a dict, from where ``deepspeed.initialize`` would read it."""
    source = next((s for s in (config, config_params, getattr(args, "deepspeed_config", None)) if s is not None), None)
    if source is None:
        return {}
    if isinstance(source, dict):
        return source
    if isinstance(source, (str, os.PathLike)):
        with open(source) as f:
            try:
                return json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"DeepSpeed config {source}: not valid JSON: {e}") from None
    raise TypeError(f"DeepSpeed config must be a dict or a path, got {type(source).__name__}")


def bucket_defaults(ds_config: dict, recommended: dict) -> dict:
    """``ds_config`` with ``recommended`` ZeRO bucket sizes filled in where the user set none."""
    zero = dict(ds_config.get("zero_optimization", {}))
    applied = {k: v for k, v in recommended.items() if k not in zero}
    if not applied:
        return ds_config
    log.info("slipstream: ZeRO bucket sizes from the tuner: %s", applied)
    return {**ds_config, "zero_optimization": {**zero, **applied}}


def initialize(*args, **kwargs):
    """Same signature and return value as ``deepspeed.initialize``."""
    import deepspeed

    original = getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize)
    return _initialize(original, args, kwargs)


def _initialize(original, args, kwargs):
    build_lock.install()  # DeepSpeed builds or loads its shm op first thing (deepspeed.comm)
    with deferred():
        return _set_up(original, args, kwargs)


def _set_up(original, args, kwargs):
    bound = inspect.signature(original).bind_partial(*args, **kwargs)
    params = bound.arguments
    ds_config = load_ds_config(params.get("config"), params.get("args"), params.get("config_params"))
    section = ds_config.get("slipstream")
    settings = read_config(section) if section is not None or not record.switch.on else _switched_on()
    if not settings.enabled:
        _left_stock(section)
        return original(*bound.args, **bound.kwargs)
    _init_distributed(original, params)
    backend = install_comm(settings.comm)
    # the world group's decision for the job's device: on NCCL, DeepSpeed's own path throughout
    # (its buckets, its reductions, its streams) and no communicator built for it
    stays = pool.decide(None, _device_type(), torch.float32, config=settings.comm)
    ours = stays is None
    overlap = settings.comm.overlap
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    # "auto" trials ZeRO-2 and ZeRO-3 on a CPU step by step, each step in one mode's sizes:
    # DeepSpeed's gradient buckets (and ZeRO-3's parameter prefetch) while blocking, as with
    # "overlap": false, the tuner's while overlapped; ZeRO-1 reduces after backward: it blocks
    trial = ours and overlap == "auto" and _on_cpu() and stage in (2, 3)
    tuned = _recommended_buckets(backend, ds_config, True) if trial else {}  # the overlapped steps' sizes
    if ours and not trial:
        ds_config = bucket_defaults(ds_config, _recommended_buckets(backend, ds_config, overlap is True))
    overlap_bucket = _overlap_bucket(ds_config, tuned, "reduce_bucket_size") if trial else None
    apply_job_effects(settings, on_cpu=_on_cpu())
    if settings.varlen is not None:
        from ...core_compile import apply_varlen

        apply_varlen(params["model"], settings.varlen)
    # Hand DeepSpeed the config with the filled-in defaults, from one place only: it refuses
    # a config given both in args.deepspeed_config and as an argument.
    params.pop("config_params", None)
    if getattr(params.get("args"), "deepspeed_config", None) is not None:
        params["args"] = copy.copy(params["args"])
        params["args"].deepspeed_config = None
    params["config"] = ds_config
    result = original(*bound.args, **bound.kwargs)
    if stage == 3 and settings.compile is not None:  # its parameter prefetch follows the forward's order
        warn_once("compile: skipped under ZeRO-3 (its layers gather parameters in hooks; they stay eager)")
        compiled = False
    else:
        # DeepSpeed's hooks: the hook-free regions; the search's budget a share of the run, if stated
        compiled = compile_model(result[0].module, settings, steps=run_length(ds_config),
                                 micro_batches=result[0].gradient_accumulation_steps())
    engine = result[0]
    chooser = _overlap_trial(backend, engine, ds_config, stage) if trial else None
    owners = ours and patch_zero_optimizer(engine.optimizer, overlap=overlap is True, trial=chooser,
                                           overlap_bucket=overlap_bucket)
    if ours and stage == 3 and (overlap is True or chooser is not None):
        patch_zero3_optimizer(engine.optimizer, trial=chooser, overlap_bucket=overlap_bucket,
                              overlap_prefetch=_overlap_bucket(ds_config, tuned, "stage3_prefetch_bucket_size"))
    overlapped = overlaps(engine.optimizer)
    if chooser is not None and not overlapped:
        chooser = None  # DeepSpeed's optimizer cannot defer its buckets here: they block
    # the parameter gather after the step behind the next forward, in the buckets' mode
    ahead = (patch_gather_ahead(engine.optimizer, backend, engine.module,
                                (lambda: chooser.overlap) if chooser is not None else (lambda: True))
             if owners and overlapped and not compiled else None)
    if owners:
        log.info("slipstream: ZeRO gradient buckets reduced to their owners (reduce-scatter)%s",
                 " (overlap auto: a trial times blocking and overlapped steps)" if chooser is not None
                 else ", during backward" if overlapped else "")
    elif overlapped:
        log.info("slipstream: ZeRO-3 gradient buckets reduce-scattered%s",
                 " (overlap auto: a trial times blocking and overlapped steps)" if chooser is not None
                 else " during backward")
    note_stack("deepspeed", engaged=True, zero_stage=stage,
               collectives=("deepspeed.comm through the core" if ours else
                            f"DeepSpeed's own ({stays})"),
               gradient_buckets_to_owners=bool(owners),
               buckets_during_backward=chooser.pending if chooser is not None else bool(overlapped),
               parameters_gathered_behind_forward=ahead is not None and (
                   "with the buckets" if chooser is not None else True),
               overlap=chooser.reason if chooser is not None else _fixed_overlap(overlap, ours, stage),
               varlen=settings.varlen is not None, compile=compiled)
    if chooser is not None:
        chooser.on_decided = note_overlap_choice("deepspeed", "buckets_during_backward")
    if ours:
        backend.communicator(None)  # built now (every rank is here) so that the line names its paths
    record.start(by_adapter=True)
    return result


def _overlap_trial(backend, engine, ds_config: dict, stage: int):
    """The ``OverlapTrial`` of a ZeRO-2/3 engine on a CPU, keyed by what its steps' times depend
    on: the model, the batch, the ZeRO stage and dtype, the buckets set, the group's layout."""
    from ...core_comm.tuner import TuneKey
    from ...core_comm.tuner.overlap import OverlapTrial

    params = [p for p in engine.module.parameters() if p.requires_grad]
    # ZeRO-3's parameters are empty outside their gathers: their full size is ds_numel
    zero = ds_config.get("zero_optimization", {})
    key = {"stack": f"deepspeed-zero{stage}", "params": sum(getattr(p, "ds_numel", p.numel()) for p in params),
           "tensors": len(params),
           "dtype": str(params[0].dtype) if params else "", "micro_batch": engine.train_micro_batch_size_per_gpu(),
           "accumulation": engine.gradient_accumulation_steps(), "buckets": zero.get("reduce_bucket_size"),
           "layout": TuneKey.of(backend.communicator(None)).filename()}
    if stage == 3:  # its blocking steps prefetch in this bucket (None: DeepSpeed's)
        key["prefetch"] = zero.get("stage3_prefetch_bucket_size")
    what = "ZeRO-3 parameter prefetch and gradient buckets" if stage == 3 else f"ZeRO-{stage} gradient buckets"
    return OverlapTrial(what, key, engine.optimizer.dp_process_group)


def _overlap_bucket(ds_config: dict, tuned: dict, name: str) -> int | None:
    """ZeRO's bucket ``name`` (``reduce_bucket_size``, ``stage3_prefetch_bucket_size``) in
    overlapped steps under ``"auto"``: the config's own, else the tuner's (``tuned``:
    ``_recommended_buckets`` with overlap)."""
    own = ds_config.get("zero_optimization", {}).get(name)
    return own if own is not None else tuned.get(name)


def _fixed_overlap(overlap, ours: bool, stage: int) -> str:
    """What ``overlap`` does where no trial runs."""
    if not ours:
        return "the stack's own"
    if overlap != "auto":
        return "forced on" if overlap else "forced off"
    why = ("ZeRO-1 reduces its buckets after backward" if stage == 1
           else "no ZeRO gradient buckets" if stage == 0
           else "trialled on a CPU only" if not _on_cpu() else "DeepSpeed's optimizer cannot defer its buckets here")
    return f"auto: blocking ({why})"


def _switched_on():
    """The settings of a DeepSpeed config without a section while slipstream is on
    (``SLIPSTREAM=1``, ``SLIPSTREAM_CONFIG``, ``slipstream.enable()``): the ``SLIPSTREAM_CONFIG``
    file's section where there is one, else the default section (ZeRO's collectives through
    the core, nothing else), as every other stack gets."""
    from ..config import SlipstreamConfig

    return SlipstreamConfig.from_env() or read_config({}, where=f"slipstream (on by {record.switch.source})")


def _left_stock(section) -> None:
    why = ("no \"slipstream\" section in the DeepSpeed config" if section is None
           else "the section says \"enabled\": false")
    note_stack("deepspeed", engaged=False, why=why)


def _init_distributed(original, params) -> None:
    """DeepSpeed's own first step of ``deepspeed.initialize``, with the same arguments, so that
    its comm backend exists to be wrapped: it adopts a group the script made, makes one, or
    refuses (``dist_init_required=False`` with no group) as it would there. Its second call,
    inside ``deepspeed.initialize``, finds the backend made."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    port = params.get("distributed_port", inspect.signature(original).parameters["distributed_port"].default)
    deepspeed.comm.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                    distributed_port=port, dist_init_required=params.get("dist_init_required"))


def _recommended_buckets(backend, ds_config: dict, overlap: bool) -> dict:
    """ZeRO bucket sizes the tuner recommends for the world group's topology, in elements of
    the training dtype (2 bytes under bf16/fp16, else 4), on a CPU with ``overlap``: the
    gradient buckets alone for ZeRO-2 (reduced during backward, ``overlap.py``) and, for
    ZeRO-3, the prefetch bucket and the gradient buckets (both during the passes); none
    elsewhere. On a GPU DeepSpeed's own sizes stand: the cost model is the CPU path's (it gave
    512K elements on 2 nodes, where DeepSpeed's own are 5e8)."""
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    # ZeRO-3 prefetches parameters asynchronously on a CPU too, but its default bucket (50M
    # elements) takes a model of this size in one all-gather, waited for at the first layer:
    # in buckets, the next is gathered while the layer before it computes. Its default
    # gradient bucket (500M elements) holds the whole model: one reduce-scatter at the end of
    # backward, with nothing left to compute beside it
    if not (overlap and _on_cpu() and stage in (2, 3)):
        # Each collective then blocks the step and waits for the slowest rank: the fewest,
        # largest buckets (DeepSpeed's own defaults) are fastest. Smaller tuned buckets were
        # 10% slower a step on 2 emulated nodes (benchmarks/results/finetune_*.md).
        log.info("slipstream: ZeRO buckets left at DeepSpeed's sizes")
        return {}
    half = any(ds_config.get(k, {}).get("enabled", False) for k in ("bf16", "fp16"))
    comm = backend.communicator(None)
    plan = comm.plan or load_plan(comm)  # a cached measured plan, else the cost model's buckets
    sizes = zero_buckets(plan.buckets, element_size=2 if half else 4)["zero_optimization"]
    gradients = {"reduce_bucket_size": sizes["reduce_bucket_size"]}
    return {"stage3_prefetch_bucket_size": sizes["stage3_prefetch_bucket_size"], **gradients} if stage == 3 else gradients


def _device_type() -> str:
    """The type of device DeepSpeed's accelerator trains on (``cpu``, ``cuda``, ...)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def _on_cpu() -> bool:
    return _device_type() == "cpu"


def install() -> None:
    """Make plain ``deepspeed.initialize`` honour the section, and torch's extension build lock
    (which every DeepSpeed job meets, building or loading the shm op) unable to hang a job
    (``build_lock``). Idempotent; ``uninstall`` undoes it."""
    import deepspeed

    build_lock.install()
    original = deepspeed.initialize
    hooked = functools.wraps(original)(lambda *args, **kwargs: _initialize(original, args, kwargs))
    patch(deepspeed, "initialize", hooked, owner="deepspeed")


def uninstall() -> None:
    """Restore ``deepspeed.initialize``, torch's build lock, DeepSpeed's own comm backend and
    every optimizer patched in this process exactly."""
    build_lock.uninstall()
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is None:
        return
    from .comm_backend import uninstall_comm
    from .zero import unpatch_all

    unpatch(deepspeed, "initialize")
    unpatch_all()
    uninstall_comm()
    undo_job_effects()
