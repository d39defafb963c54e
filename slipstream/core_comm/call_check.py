"""``SLIPSTREAM_DEBUG=1``: before every collective, the ranks of a group agree that they make
the same call, or every one of them raises an error naming the rank that differs.

The check runs over the group's store, not a collective, so a rank whose call goes to gloo and
one whose call takes the fast path both reach it: a disagreement across paths is found at once.
Each rank writes its call under the check's sequence number and waits, within the group's
deadline, for every rank's entry (naming a rank whose entry does not come). A rank deletes its
previous entry once every rank has written the next one, so the store holds at most two each.

``with_first_failure``, always on, names the job's first failure in a later rank's error, through
the default store too.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from datetime import timedelta

import torch.distributed as dist

__all__ = ["CallCheck", "CollectiveMismatch", "checked", "with_first_failure"]

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


_FIRST_FAILURE = "slipstream-first-failure"


def with_first_failure(error: Exception, within_s: float = 1.0) -> Exception:
    """``error``, naming the job's first failure when another rank's came first. A failure
    cascades (rank 3 dies; its node peer rank 2 raises and exits; rank 0 then loses its
    connection to rank 2), so each rank records its error in the default store, first writer
    wins, and a later one names the first: rank 0's error then says rank 3 died. The store
    gets ``within_s`` seconds: a store across a link that is down would hold the error back
    for as long as the link stays down, so without an answer the error goes as it is."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group: the error as it is
        return error
    mine = f"global rank {dist.get_rank()}: {error}"
    answer: list = []

    def record() -> None:
        try:
            answer.append(store.compare_set(_FIRST_FAILURE, "", mine).decode())
        except Exception:  # noqa: BLE001 - the store's host is gone: no answer
            pass

    asking = threading.Thread(target=record, name="slipstream-first-failure", daemon=True)
    asking.start()
    asking.join(within_s)
    first = answer[0] if answer else ""
    if first == mine or not first:
        return error
    try:
        return type(error)(f"{error} (the first failure in the job, on {first})")
    except Exception:  # noqa: BLE001 - an error type that takes other arguments
        return RuntimeError(f"{error} (the first failure in the job, on {first})")
