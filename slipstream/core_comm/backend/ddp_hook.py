"""A DDP communication hook that averages gradient buckets through the core, for users who
keep their own backend (gloo)::

    model.register_comm_hook(None, slipstream.ddp_hook)                    # WORLD
    model.register_comm_hook(slipstream.DDPHookState(group), slipstream.ddp_hook)

Like torch's ``default_hooks.allreduce_hook`` it divides the bucket by the group size, then
sums it, so the result equals DDP's own (bitwise where the summation order is the same). The
state is the process group (None: WORLD) or a ``DDPHookState``, which also takes a
``CommConfig``. The communicator comes from the pool, built on the first bucket the routing
decision gives the core (a collective: DDP reduces buckets in the same order on every rank).
A bucket the decision leaves to the group (CUDA on NCCL) is torch's own ``allreduce_hook``:
the stock future, whose waiters' streams wait for NCCL's, and no communicator. DDP checks the hook's annotations
(``bucket: dist.GradBucket``, a ``Future[Tensor]`` result): no postponed annotations here.
"""

import torch
import torch.distributed as dist

from .. import pool
from ..config import CommConfig

__all__ = ["DDPHookState", "ddp_hook"]


class DDPHookState:
    """The group a hook reduces over and its settings; the communicator is the pool's."""

    __slots__ = ("process_group", "config")

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, config: CommConfig | None = None) -> None:
        if config is not None and not isinstance(config, CommConfig):
            raise ValueError(f"config must be a CommConfig, got {type(config).__name__}")
        self.process_group = process_group
        """None: the default group."""
        self.config = config
        """None: the pool's default (``pool.default_config``) when the communicator is built."""

    def communicator(self, buffer: torch.Tensor):
        """The communicator that reduces ``buffer`` on the group (collective the first time),
        or None where the routing decision leaves it to the group's own all-reduce."""
        return pool.for_call(self.process_group, buffer, kind="all_reduce", config=self.config)


def ddp_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket.buffer()`` (flat, the bucket's dtype and device) over the group; a
    future of the averaged buffer, as DDP expects. Runs on the communicator's worker thread
    when the core takes the call; otherwise it is the group's own async allreduce, its future
    as torch's ``allreduce_hook`` returns it."""
    hook_state = state if isinstance(state, DDPHookState) else DDPHookState(state)
    buffer = bucket.buffer()
    comm = hook_state.communicator(buffer)
    if comm is None:
        buffer.div_(dist.get_world_size(hook_state.process_group))
        work = dist.all_reduce(buffer, group=hook_state.process_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    buffer.div_(comm.world)
    work = comm.all_reduce(buffer, dist.ReduceOp.SUM, async_op=True)
    return work.returning(buffer).get_future()
