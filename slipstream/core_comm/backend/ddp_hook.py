"""A DDP communication hook that averages gradient buckets through the core, for users who
keep their own backend (gloo)::

    model.register_comm_hook(None, slipstream.ddp_hook)                    # WORLD
    model.register_comm_hook(slipstream.DDPHookState(group), slipstream.ddp_hook)

Like torch's ``default_hooks.allreduce_hook`` it divides the bucket by the group size, then
sums it, so the result equals DDP's own (bitwise where the summation order is the same). The
state is the process group (None: WORLD) or a ``DDPHookState``, which also takes a
``CommConfig``. The communicator comes from the pool, built on the first bucket (a collective:
DDP reduces buckets in the same order on every rank). DDP checks the hook's annotations
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
        """None: ``CommConfig.default()`` when the communicator is built."""

    def communicator(self):
        """The communicator of the group (collective the first time)."""
        return pool.get(self.process_group, config=self.config)


def ddp_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket.buffer()`` (flat, the bucket's dtype and device) over the group; a
    future of the averaged buffer, as DDP expects. Runs on the communicator's worker thread
    when the core takes the call; otherwise it is the group's own async allreduce."""
    hook_state = state if isinstance(state, DDPHookState) else DDPHookState(state)
    comm = hook_state.communicator()
    buffer = bucket.buffer()
    buffer.div_(comm.world)
    work = comm.all_reduce(buffer, dist.ReduceOp.SUM, async_op=True)
    return work.returning(buffer).get_future()
