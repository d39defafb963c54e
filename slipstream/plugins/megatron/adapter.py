"""Megatron-core's tensor- and data-parallel collectives through the core (docs/megatron.md).

- ``install()`` (run when ``megatron.core`` is imported after ``slipstream.enable()``): the
  groups ``initialize_model_parallel`` makes inherit the default backend, so they need no
  patch; it checks them once made and warns naming one that is not on slipstream.
- Megatron-LM: ``add_arguments`` (its ``extra_args_provider``) adds the ``--slipstream*``
  flags; ``slipstream.megatron.initialize(args)`` acts on them (``read_arguments``,
  ``name_backend``) before Megatron initialises torch.distributed.
- ``enable_compile``: Megatron-LM builds and wraps the model inside ``pretrain``, out of the
  user's reach, so each module its ``DistributedDataParallel`` wraps goes to
  ``slipstream.compile`` as it is wrapped (a reversible patch of the wrapper's ``__init__``).
- ``process_groups()``, for users who keep another default backend: slipstream copies of
  parallel_state's groups, and its getters answering them (reversible).
"""

from __future__ import annotations

import argparse
import functools
from typing import TYPE_CHECKING

import torch.distributed as dist

from ..._common.record import note_stack, warn_once
from ..._common.patch import is_patched, patch, uninstall_all
from .overlap import OWNER as OVERLAP_OWNER, engage, prepare

if TYPE_CHECKING:
    from ..config import SlipstreamConfig

__all__ = ["add_arguments", "chain", "disable_compile", "enable_compile", "install", "name_backend", "process_groups",
           "read_arguments", "restore_process_groups", "uninstall"]

_OWNER = "megatron"
# parallel_state getters whose groups ``process_groups`` gives slipstream copies, by collection field
_GETTERS = {"tp": "get_tensor_model_parallel_group", "dp": "get_data_parallel_group",
            "pp": "get_pipeline_model_parallel_group", "mp": "get_model_parallel_group",
            "cp": "get_context_parallel_group"}


# ------------------------------------------------------------------ Megatron-LM arguments
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's ``extra_args_provider``: adds slipstream's flags; returns the parser."""
    group = parser.add_argument_group(title="slipstream")
    group.add_argument("--slipstream", action="store_true",
                       help="route CPU collectives of every Megatron group through slipstream")
    group.add_argument("--slipstream-varlen", action="store_true",
                       help="let the local DotProductAttention take packed (THD) sequences, computed per "
                            "sequence (Transformer Engine's attention takes them already)")
    group.add_argument("--slipstream-compile", action="store_true",
                       help="compile the model with the strategy measured fastest on the first steps, checked "
                            "against eager, falling back to eager on any failure (slipstream.compile)")
    group.add_argument("--slipstream-config", metavar="PATH", default=None,
                       help="JSON or YAML file of slipstream's settings (the DeepSpeed section's format)")
    return parser


def chain(*providers):
    """One ``extra_args_provider`` that runs each of ``providers`` (yours, ``add_arguments``)."""
    def provider(parser):
        for p in providers:
            parser = p(parser) or parser
        return parser

    return provider


def read_arguments(args: argparse.Namespace) -> tuple[bool, "SlipstreamConfig | None"]:
    """Act on the parsed flags that need no collective (``--slipstream-varlen``,
    ``--slipstream-compile``), and return whether slipstream's collectives are asked for
    (``--slipstream``) with the settings of ``--slipstream-config`` (None without it). A bad
    ``--slipstream-config`` is refused naming the flag and the file. ``slipstream.megatron
    .initialize`` is the entry point: it turns the collectives on as well."""
    if getattr(args, "slipstream_varlen", False):  # compute only: it needs no collective
        from .packed import enable_packed_attention

        enable_packed_attention()
        note_stack("megatron-varlen", engaged=True, by="--slipstream-varlen",
                   local_attention="takes packed (THD) sequences")
    on, compiling = getattr(args, "slipstream", False), getattr(args, "slipstream_compile", False)
    settings = None
    if getattr(args, "slipstream_config", None):
        if not (on or compiling):
            raise ValueError("--slipstream-config needs --slipstream or --slipstream-compile")
        from ..config import SlipstreamConfig

        try:
            settings = SlipstreamConfig.from_file(args.slipstream_config)
        except ValueError as e:
            raise ValueError(f"--slipstream-config: {e}") from None
    compile_config = settings.compile if settings is not None else None
    if compiling:  # the flag switches on the file's section, or the defaults
        import dataclasses

        from ...core_compile.autotune.config import CompileConfig

        compile_config = dataclasses.replace(compile_config or CompileConfig(), enabled=True)
    if compile_config is not None and compile_config.enabled:
        enable_compile(compile_config, steps=train_iterations(args))
    return on, settings


def name_backend(args: argparse.Namespace) -> None:
    """The backend Megatron-LM will initialise torch.distributed with: ``slipstream`` for CPU
    tensors (CUDA keeps NCCL)."""
    backend = getattr(args, "distributed_backend", None)
    if backend in (None, "gloo"):
        args.distributed_backend = "slipstream"
    elif backend == "nccl":
        args.distributed_backend = "cpu:slipstream,cuda:nccl"


# ------------------------------------------------------------------ compile
def enable_compile(config=None, steps: int | None = None) -> None:
    """From now on, each module Megatron's ``DistributedDataParallel`` wraps goes through
    ``slipstream.compile(module, config=config, group=<its data-parallel group>)`` at the end of
    the wrapper's ``__init__``. ``steps``: the run's iterations (``--train-iters``), each of as
    many forward calls of the module as Megatron's micro-batches then (``micro_batches``).
    Idempotent (the latest ``config`` holds); ``disable_compile`` undoes it (modules already
    wrapped keep their autotuner: ``slipstream.uncompile``)."""
    from ...core_compile.autotune.config import CompileConfig

    config = CompileConfig() if config is None else config
    if not isinstance(config, CompileConfig):
        raise TypeError(f"config must be a CompileConfig, got {type(config).__name__}")
    _DDP.compile = (config, steps)
    _DDP.wrap()


def disable_compile() -> None:
    _DDP.compile = None
    _DDP.unwrap_unless_needed()


class _DDPInit:
    """What slipstream does to each Megatron ``DistributedDataParallel`` as it is built, through
    one reversible patch of its ``__init__`` (owner ``megatron-ddp``): the gradient buckets'
    overlap (``overlap.py``; while the adapter is installed) and the compile hook (while
    ``enable_compile`` holds)."""

    def __init__(self) -> None:
        self.compile = None
        """``(CompileConfig, steps)`` while ``enable_compile`` holds."""
        self.overlap = False
        """Whether the adapter is installed (the buckets' overlap is then prepared)."""

    def wrap(self) -> None:
        from megatron.core.distributed import distributed_data_parallel as ddp_module

        cls = ddp_module.DistributedDataParallel
        if is_patched(cls, "__init__"):
            return
        original, state = cls.__init__, self

        @functools.wraps(original)
        def __init__(self, config, ddp_config, module, disable_bucketing=False, pg_collection=None, **kwargs):
            plan = prepare(config, ddp_config, module, disable_bucketing, pg_collection) if state.overlap else None
            original(self, config, plan.ddp_config if plan is not None else ddp_config, module,
                     disable_bucketing=disable_bucketing, pg_collection=pg_collection, **kwargs)
            if plan is not None:
                engage(self, plan)
            if state.compile is not None:
                state.compile_module(self)

        patch(cls, "__init__", __init__, owner=_OWNER + "-ddp")

    def unwrap_unless_needed(self) -> None:
        if self.compile is None and not self.overlap:
            uninstall_all(_OWNER + "-ddp")

    def compile_module(self, ddp) -> None:
        from ...core_compile import compile as compile_

        config, steps = self.compile
        group = getattr(ddp, "dp_cp_group", None)  # the ranks that see the same model
        compile_(ddp.module, config=config.with_run_length(steps, micro_batches()), group=group)
        note_stack("megatron-compile", engaged=True, by="--slipstream-compile",
                   model=f"{type(ddp.module).__name__} under Megatron's DDP: strategy chosen by measurement "
                         "(slipstream.compile_report(ddp.module))")


_DDP = _DDPInit()


def train_iterations(args: argparse.Namespace) -> int | None:
    """The run's iterations: ``--train-iters``, else ``--train-samples`` over the global batch
    (Megatron-LM's rule for a run stated in samples); None where neither is known."""
    iters, samples, batch = (getattr(args, k, None) for k in ("train_iters", "train_samples", "global_batch_size"))
    if iters is not None or not samples or not batch:
        return iters
    return samples // batch


def micro_batches() -> int:
    """Forward calls of a wrapped module per iteration: Megatron's micro-batches (global batch
    over micro-batch times data-parallel size), 1 where its calculator is not set up."""
    from megatron.core import num_microbatches_calculator as calculator

    try:
        return calculator.get_num_microbatches()
    except AttributeError:  # no calculator: megatron-core used without Megatron-LM's set-up
        return 1


# ------------------------------------------------------------------ the check after set-up
def install() -> None:
    """Check the model-parallel groups once Megatron has made them. Idempotent."""
    from megatron.core import parallel_state

    original = parallel_state.initialize_model_parallel

    @functools.wraps(original)
    def initialize_model_parallel(*args, **kwargs):
        result = original(*args, **kwargs)
        _check_groups(parallel_state)
        return result

    patch(parallel_state, "initialize_model_parallel", initialize_model_parallel, owner=_OWNER)
    _DDP.overlap = True
    _DDP.wrap()


def uninstall() -> None:
    from .packed import disable_packed_attention

    restore_process_groups()
    uninstall_all(_OWNER)
    uninstall_all(OVERLAP_OWNER)
    disable_packed_attention()
    _DDP.overlap = False
    disable_compile()


def _check_groups(parallel_state) -> None:
    facts = {}
    for field, group in (("tp", parallel_state.get_tensor_model_parallel_group(check_initialized=False)),
                         ("dp", parallel_state.get_data_parallel_group())):
        if group is None or dist.get_world_size(group) == 1:
            continue
        backend = dist.get_backend_config(group)
        facts[field] = f"{dist.get_world_size(group)} ranks on {backend}"
        if "slipstream" not in backend:
            warn_once(f"Megatron's {field} group runs on {backend!r}: its collectives stay stock. Call "
                      "slipstream.enable() before init_process_group (no backend named), or use "
                      "slipstream.megatron.process_groups()")
    note_stack("megatron", engaged=all("slipstream" in v for v in facts.values()) and bool(facts), **facts)


# ------------------------------------------------------------------ groups on slipstream
_COPIES: dict[tuple, dist.ProcessGroup] = {}  # ranks of one of parallel_state's groups -> its slipstream copy


def _copy_of(group):
    """The slipstream group of ``group``'s ranks, made once per set of ranks."""
    if group is None:
        return None
    ranks = tuple(dist.get_process_group_ranks(group))
    copy = _COPIES.get(ranks)
    if copy is None or copy not in dist.distributed_c10d._world.pg_map:  # none yet, or destroyed
        _COPIES[ranks] = dist.new_group(list(ranks), backend="slipstream", use_local_synchronization=True)
    return _COPIES[ranks]


def process_groups():
    """A ``ProcessGroupCollection`` of parallel_state's groups on slipstream (collective over
    each group's members), and parallel_state's getters for them answering the same copies
    (reversible: ``restore_process_groups``). Needs ``initialize_model_parallel`` first."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("process_groups() needs parallel_state.initialize_model_parallel first")
    copies = {}
    for field, getter in _GETTERS.items():
        original = getattr(parallel_state, getter)
        original = getattr(original, "__wrapped__", original) if is_patched(parallel_state, getter) else original
        try:
            group = original(check_initialized=False)
        except TypeError:  # get_data_parallel_group takes no such argument
            group = original()
        copies[field] = _copy_of(group)  # made now, by every member alike

        def answer(*args, _original=original, **kwargs):
            # the copy of whatever group the getter names (other arguments: other groups)
            return _copy_of(_original(*args, **kwargs))

        patch(parallel_state, getter, functools.wraps(original)(answer), owner=_OWNER + "-groups")
    collection = ProcessGroupCollection.use_mpu_process_groups()
    for field, copy in copies.items():
        if copy is not None:
            setattr(collection, field, copy)
    note_stack("megatron", engaged=True, groups="slipstream copies of parallel_state's (process_groups())")
    return collection


def restore_process_groups() -> None:
    """Undo ``process_groups``' patch of parallel_state's getters (the copies stay alive)."""
    uninstall_all(_OWNER + "-groups")
