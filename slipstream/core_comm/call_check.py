"""``SLIPSTREAM_DEBUG=1``: before every collective, the ranks of a group agree that they make
the same call, or every one of them raises an error naming the rank that differs.

The check runs over the group's store, not a collective, so a rank whose call goes to gloo and
one whose call takes the fast path both reach it: a disagreement across paths is found at once.
Each rank writes its call under the check's sequence number and waits, within the group's
deadline, for every rank's entry (naming a rank whose entry does not come). A rank deletes its
previous entry once every rank has written the next one, so the store holds at most two each.
"""

from __future__ import annotations

import contextlib
import contextvars
from datetime import timedelta

import torch.distributed as dist

__all__ = ["CallCheck", "CollectiveMismatch", "checked"]

# Set while the backend, having checked a call, hands it to the communicator.
_CHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("slipstream_call_checked", default=False)


class CollectiveMismatch(ValueError):
    """The ranks of a group called different collectives."""


@contextlib.contextmanager
def checked():
    """The calls made inside were checked already (by the backend)."""
    token = _CHECKED.set(True)
    try:
        yield
    finally:
        _CHECKED.reset(token)


class CallCheck:
    """The check of one group: ``check(call)`` returns when every rank made ``call``."""

    def __init__(self, store: dist.Store, rank: int, world: int, timeout_s: float) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.timeout_s = timeout_s
        self._seq = 0

    @classmethod
    def for_group(cls, group: dist.ProcessGroup | None, timeout_s: float) -> "CallCheck":
        """The check of any group of the default one, over the default store."""
        store = dist.distributed_c10d._get_default_store()
        name = dist.distributed_c10d._get_process_group_name(group or dist.group.WORLD)
        prefixed = dist.PrefixStore(f"slipstream-check/{name}/", store)
        return cls(prefixed, dist.get_rank(group), dist.get_world_size(group), timeout_s)

    def check(self, call: str) -> None:
        if _CHECKED.get():
            return
        seq = self._seq
        self._seq += 1
        keys = [f"{seq}/{r}" for r in range(self.world)]
        self.store.set(keys[self.rank], call)
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - a timeout, or the store's host is gone
            missing = self._missing(keys)
            raise TimeoutError(f"SLIPSTREAM_DEBUG: group rank(s) {missing or '(unknown: the store is unreachable)'} "
                               f"did not reach collective #{seq} within {self.timeout_s:g} s; group rank "
                               f"{self.rank} calls {call} ({e})") from None
        calls = [v.decode() for v in self.store.multi_get(keys)]
        if seq > 0:
            self.store.delete_key(f"{seq - 1}/{self.rank}")
        differ = [r for r, other in enumerate(calls) if other != call]
        if differ:
            r = differ[0]
            raise CollectiveMismatch(f"collective #{seq} differs across ranks: group rank {self.rank} calls "
                                     f"{call}, group rank {r} calls {calls[r]}")

    def _missing(self, keys: list[str]) -> list[int]:
        try:
            return [r for r, k in enumerate(keys) if not self.store.check([k])]
        except Exception:  # noqa: BLE001
            return []
