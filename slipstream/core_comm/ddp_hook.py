"""A DDP communication hook that averages gradient buckets through the core, for users who
keep their own backend (gloo)::

    model.register_comm_hook(None, slipstream.ddp_hook)                    # WORLD
    model.register_comm_hook(slipstream.DDPHookState(group), slipstream.ddp_hook)

Like torch's ``default_hooks.allreduce_hook`` it divides the bucket by the group size, then
sums it across ranks, so the result equals DDP's own (bitwise where the summation order is the
same). The state is the process group (None: WORLD) or a ``DDPHookState``, which also takes a
``CommConfig``. The communicator is built on the first bucket, a collective: DDP reduces
buckets in the same order on every rank.

DDP checks the hook's annotations (``bucket: dist.GradBucket``, a ``Future[Tensor]`` result),
so this module does not use postponed annotations.
"""

import torch
import torch.distributed as dist

from .communicator import as_torch_future
from .config import CommConfig

__all__ = ["DDPHookState", "ddp_hook"]


class DDPHookState:
    """The group a hook reduces over, its settings, and its communicator once built."""

    __slots__ = ("process_group", "config", "_comm")

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, config: CommConfig | None = None) -> None:
        if config is not None and not isinstance(config, CommConfig):
            raise ValueError(f"config must be a CommConfig, got {type(config).__name__}")
        self.process_group = process_group
        """None: the default group."""
        self.config = config
        """None: ``CommConfig.from_env()`` when the communicator is built."""
        self._comm = None

    def communicator(self):
        """The communicator of the group (collective the first time)."""
        if self._comm is None:
            from .communicator import Communicator

            group = self.process_group if self.process_group is not None else dist.group.WORLD
            self._comm = Communicator(group, config=self.config)
        return self._comm


# Hook state built for a bare group passed as the state: group -> DDPHookState. An entry
# whose group was destroyed is rebuilt (checked on use).
_STATES: dict = {}


def _state_of(state) -> DDPHookState:
    if isinstance(state, DDPHookState):
        return state
    group = state if state is not None else dist.group.WORLD
    found = _STATES.get(group)
    if found is None or group not in dist.distributed_c10d._world.pg_map:
        found = _STATES[group] = DDPHookState(group)
    return found


def ddp_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket.buffer()`` (flat, the bucket's dtype and device) over the group.

    Returns a future of the averaged buffer, as DDP expects. Runs on the communicator's
    worker thread when the core takes the call; otherwise it is the group's own async
    allreduce.
    """
    hook_state = _state_of(state)
    comm = hook_state.communicator()
    buffer = bucket.buffer()
    buffer.div_(comm.world)
    work = comm.all_reduce(buffer, dist.ReduceOp.SUM, async_op=True)
    return as_torch_future(work, buffer)
